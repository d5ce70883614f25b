"""Shards as Ray actors: the same :class:`~.state.ShardState` and op table as the pipe worker,
placed by Ray across the nodes of a cluster (``oprag serve --ray-address ADDR|auto|local``).

Ray is an optional extra (``pip install -e ".[ray]"``); this module imports it only when a
:class:`RayPlacement` connects, so the default path never needs it.

Placement and restart: one placement group with one bundle of ``shard_cpus`` CPUs per shard
(strategy ``SPREAD`` by default, see :class:`~oprag_server.config.RayConfig`); each shard is an
actor in its bundle with ``max_restarts`` set and ``max_task_retries=0``: a call Ray reports
as failed may have run, so only OpRAG's commit protocol decides what is retried. When Ray
restarts an actor (a lost node: the bundle is rescheduled elsewhere) it re-runs the constructor,
which holds no data; the frontend's supervisor then calls :meth:`RayTransport.revive`, which
loads the shard's snapshot and replays its committed write-ahead log from the data directory.
That directory must therefore be storage every node reads at the same path (a shared volume).

Data plane: requests and replies cross as pickle bytes (protocol 5), exactly what the pipe
transport sends, so replies hold writable numpy arrays (arrays Ray deserialises itself are
read-only views of its object store) and chunk vectors never leave the actor.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .protocol import Op, StatsReply, StatsRequest
from .state import ShardState, dispatch, op_table
from .transport import _THREAD_VARS, ShardError, ShardTransport

__all__ = ["RayPlacement", "RayTransport", "ShardActor"]


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


class ShardActor:
    """The body of a shard actor. The constructor holds no data (Ray re-runs it on a restart);
    :meth:`load` builds the shard from storage. Each construction has a fresh ``incarnation``
    id, so the frontend can tell a restarted actor from the one it loaded."""

    def __init__(self, shard_id: int, dim: int, data_dir: str | None, stem: bool) -> None:
        try:
            import faiss

            faiss.omp_set_num_threads(1)
        except Exception:  # pragma: no cover
            pass
        self.shard_id, self.dim, self.stem = shard_id, dim, stem
        self.data_dir = Path(data_dir) if data_dir else None
        self.incarnation = uuid.uuid4().hex
        self.state: ShardState | None = None
        self.table: dict = {}

    def load(self, committed: set[str] | None) -> tuple[str, bool, Any]:
        """(Re)build the shard: snapshot + committed log records.

        :returns: ``(incarnation, ok, StatsReply with lexical stats and replayed | error text)``.
        """
        try:
            state = ShardState(self.shard_id, self.dim, self.data_dir, stem=self.stem)
            replayed = state.load(committed)
            ready = state.stats(StatsRequest(lexical=True))
            ready.replayed = replayed
        except Exception as exc:  # noqa: BLE001 - reported to the frontend
            return self.incarnation, False, f"{type(exc).__name__}: {exc}"
        self.state, self.table = state, op_table(state)
        return self.incarnation, True, _dumps(ready)

    def ping(self) -> tuple[str, bool, str]:
        """``(incarnation, loaded, node id)``."""
        node = os.environ.get("RAY_NODE_ID", "")
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except Exception:  # pragma: no cover - outside Ray
            pass
        return self.incarnation, self.state is not None, node

    def call(self, blob: bytes) -> tuple[bool, Any]:
        """One pickled ``(Op, request)``. :returns: ``(True, pickled reply)`` or ``(False, error)``."""
        if self.state is None:
            return False, "shard actor restarted and not loaded yet"
        try:
            op, req = pickle.loads(blob)
            return True, _dumps(dispatch(self.table, op, req))
        except Exception as exc:  # noqa: BLE001 - a bad request never kills the shard
            return False, f"{type(exc).__name__}: {exc}"


class RayPlacement:
    """Connects to Ray, owns the placement group, and makes one :class:`RayTransport` per shard
    (it is the ``transport`` factory of :class:`~.pool.ShardPool`).

    :param cfg: a :class:`~oprag_server.config.RayConfig` (address, strategy, max_restarts,
        shard_cpus, ping_s). :param n: shards (one bundle each).
    """

    def __init__(self, cfg: Any, n: int) -> None:
        self.cfg, self.n = cfg, n
        self.pg: Any = None
        self._started_ray = False
        self._lock = threading.Lock()

    def connect(self, timeout_s: float = 120.0) -> Any:
        """``ray.init`` (unless already connected) and the placement group, once (blocking).

        :raises RuntimeError: Ray is not installed, or the bundles cannot be placed in time.
        """
        with self._lock:
            try:
                import ray
                from ray.util.placement_group import placement_group
            except ImportError as exc:
                raise RuntimeError("--ray-address needs Ray: pip install 'oprag[ray]'") from exc
            if not ray.is_initialized():
                env = {"env_vars": {k: "1" for k in _THREAD_VARS}}
                if self.cfg.address == "local":
                    cpus = max(os.cpu_count() or 1, int(self.n * self.cfg.shard_cpus + 0.999))
                    _init_on_keeper_thread(ray, num_cpus=cpus, runtime_env=env, include_dashboard=False,
                                           log_to_driver=False)
                else:
                    ray.init(address=self.cfg.address, runtime_env=env, log_to_driver=False)
                self._started_ray = True
            if self.pg is None:
                pg = placement_group([{"CPU": self.cfg.shard_cpus}] * self.n, strategy=self.cfg.strategy)
                if not pg.wait(timeout_s):
                    raise RuntimeError(f"Ray could not place {self.n} shard bundles of {self.cfg.shard_cpus} CPU "
                                       f"({self.cfg.strategy}) within {timeout_s:.0f} s")
                self.pg = pg
            return ray

    def new_actor(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool) -> Any:
        """A shard actor in bundle ``shard_id`` of the placement group."""
        ray = self.connect()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(ShardActor).options(
            num_cpus=self.cfg.shard_cpus, max_restarts=self.cfg.max_restarts, max_task_retries=0,
            max_concurrency=1, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=shard_id))
        # absolute: an actor does not run in the frontend's working directory
        return cls.remote(shard_id, dim, str(Path(data_dir).resolve()) if data_dir else None, stem)

    def __call__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> "RayTransport":
        return RayTransport(shard_id, dim, data_dir, stem, placement=self)

    def release(self) -> None:
        """Remove the placement group (and stop Ray when this process started it)."""
        if self.pg is None and not self._started_ray:
            return
        import ray

        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - Ray already gone
                pass
            self.pg = None
        if self._started_ray and self.cfg.address == "local":
            ray.shutdown()
        self._started_ray = False


class RayTransport(ShardTransport):
    """One shard actor. A monitor thread pings it every ``ping_s``; a failed or timed-out ping,
    a failed call, or a new incarnation (Ray restarted it) marks the shard down, fails its
    pending calls with :class:`ShardError` and makes :meth:`is_alive` False, so the supervisor
    revives it while queries are answered partially and writes get UNAVAILABLE."""

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False, *,
                 placement: RayPlacement) -> None:
        super().__init__(shard_id, dim, data_dir, stem)
        self.placement = placement
        self.actor: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.incarnation: str | None = None
        self.node_id: str | None = None
        self._load_ref: Any = None
        self._pending: set[asyncio.Future] = set()
        self._alive = False
        self._closed = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- life cycle -------------------------------------------------------------------------
    def start(self, committed: set[str] | None) -> None:
        self.actor = self.placement.new_actor(self.shard_id, self.dim, self.data_dir, self.stem)
        self._load_ref = self.actor.load.remote(committed or set())

    def ready(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> StatsReply:
        import ray

        try:
            inc, ok, res = ray.get(self._load_ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise ShardError(f"shard {self.shard_id} did not report READY within {timeout_s:.0f} s") from exc
        except ray.exceptions.RayError as exc:
            raise ShardError(f"shard {self.shard_id} actor failed while loading: {exc}") from exc
        if not ok:
            raise ShardError(f"shard {self.shard_id} failed to start: {res}")
        self.loop, self.incarnation = loop, inc
        self.node_id = ray.get(self.actor.ping.remote(), timeout=timeout_s)[2]
        self._alive = True
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name=f"shard-{self.shard_id}-ray-ping", daemon=True)
            self._monitor.start()
        return pickle.loads(res)

    def revive(self, loop: asyncio.AbstractEventLoop, committed: set[str] | None, timeout_s: float) -> StatsReply:
        """Bring the shard back (blocking): reload the actor Ray restarted (it waits for Ray to
        place it), or a new actor in the same bundle when Ray gave up on the old one.

        :returns: READY stats. :raises ShardError: not back within ``timeout_s``.
        """
        import ray

        self._mark_down("revived")
        deadline = time.monotonic() + timeout_s
        while True:  # loading is idempotent (a rebuild from storage), so it may be retried
            try:
                self._load_ref = self.actor.load.remote(committed or set())
                return self.ready(loop, max(1.0, deadline - time.monotonic()))
            except ShardError as exc:
                cause = exc.__cause__
                if isinstance(cause, ray.exceptions.ActorDiedError):
                    break
                if not isinstance(cause, ray.exceptions.ActorUnavailableError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # Ray is restarting the actor (placing its bundle)
        try:  # restarts exhausted: a new actor in the same bundle
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        self.start(committed)
        return self.ready(loop, max(1.0, deadline - time.monotonic()))

    def _watch(self) -> None:
        import ray

        while not self._closed.wait(self.placement.cfg.ping_s):
            if not self._alive:
                continue
            try:
                inc, loaded, node = ray.get(self.actor.ping.remote(), timeout=max(2.0, 4 * self.placement.cfg.ping_s))
            except Exception as exc:  # noqa: BLE001 - timeout, actor died or restarting
                self._mark_down(f"ping failed: {type(exc).__name__}")
                continue
            if inc != self.incarnation or not loaded:
                self._mark_down("actor restarted by Ray")
            self.node_id = node

    def _mark_down(self, why: str) -> None:
        self._alive = False
        loop = self.loop
        pending, self._pending = self._pending, set()
        if loop is not None and not loop.is_closed():
            for fut in pending:
                loop.call_soon_threadsafe(_fail, fut, f"shard {self.shard_id} is down: {why}")

    # -- calls ------------------------------------------------------------------------------
    def call(self, op: Op, request: Any) -> asyncio.Future:
        loop = self.loop or asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._alive:
            fut.set_exception(ShardError(f"shard {self.shard_id} is not running"))
            return fut
        try:
            ref = self.actor.call.remote(_dumps((op, request)))
        except Exception as exc:  # noqa: BLE001 - e.g. the actor handle is dead
            fut.set_exception(ShardError(f"shard {self.shard_id}: {exc}"))
            return fut
        self._pending.add(fut)
        ref.future().add_done_callback(lambda cf: loop.call_soon_threadsafe(self._resolve, fut, cf))
        return fut

    def _resolve(self, fut: asyncio.Future, cf: Any) -> None:
        self._pending.discard(fut)
        if fut.done():
            return
        try:
            ok, res = cf.result()
        except Exception as exc:  # noqa: BLE001 - RayActorError & co: the shard is down
            self._mark_down(type(exc).__name__)
            fut.set_exception(ShardError(f"shard {self.shard_id} is down: {type(exc).__name__}"))
            return
        if ok:
            fut.set_result(pickle.loads(res))
        else:
            fut.set_exception(ShardError(f"shard {self.shard_id}: {res}"))

    def is_alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        """End the actor for good (no Ray restart)."""
        self._mark_down("killed")
        if self.actor is not None:
            import ray

            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self._closed.set()
        self.kill()


def _init_on_keeper_thread(ray: Any, **kw: Any) -> None:
    """``ray.init(**kw)`` on a thread that lives as long as the process: a local Ray instance's
    processes die with the thread that started them (parent-death signal), and the frontend
    starts shards from short-lived executor threads."""
    done, err = threading.Event(), []

    def keep() -> None:
        try:
            ray.init(**kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            err.append(exc)
        done.set()
        if not err:
            threading.Event().wait()

    threading.Thread(target=keep, name="oprag-ray-keeper", daemon=True).start()
    done.wait()
    if err:
        raise err[0]


def _fail(fut: asyncio.Future, msg: str) -> None:
    if not fut.done():
        fut.set_exception(ShardError(msg))
