"""Shards as Ray actors: the same :class:`~.state.ShardState` and op table as the pipe worker,
placed by Ray across the nodes of a cluster (``oprag serve --ray-address ADDR|auto|local``).

Ray is an optional extra (``pip install -e ".[ray]"``), imported only once a placement connects.

Placement and restart: one placement group, one bundle of ``shard_cpus`` CPUs per shard
(strategy ``SPREAD`` by default: :class:`~oprag_server.config.RayConfig`); each shard is an
actor in its bundle with ``max_restarts`` set and ``max_task_retries=0`` (a call Ray reports
failed may have run: OpRAG's commit protocol decides what is retried). Ray restarts an actor
(a lost node: its bundle is placed elsewhere) by re-running the constructor, which holds no
data; the supervisor then calls :meth:`RayTransport.revive`, which loads the snapshot and
replays the committed log from the data directory, so that must be at the same path on every
node (a shared volume), or from ``--storage-uri`` (object storage; the data directory is then
each node's local working copy, :mod:`.storage`).

Data plane (``RayConfig.channel``): ``"direct"`` (default) opens a TCP connection from the
frontend to each actor carrying the pipe protocol (the actor listens, authenticated by a random
key it hands over through Ray); ``"actor"`` sends each request as a Ray actor call. Either way
requests and replies are pickled exactly as over a pipe, so replies hold writable numpy arrays
(arrays Ray deserialises itself are read-only views of its object store) and chunk vectors
never leave the actor. bench/RESULTS.md ("Shards on Ray") has the round trips of both.
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
from .transport import _THREAD_VARS, PipeTransport, ShardError, ShardTransport

__all__ = ["RayPlacement", "RayTransport", "ShardActor"]


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


class ShardActor:
    """The body of a shard actor. The constructor holds no data (Ray re-runs it on a restart); :meth:`load` builds
    the shard from storage. Each construction has a fresh ``incarnation`` id: a restarted actor is told apart."""

    def __init__(self, shard_id: int, dim: int, data_dir: str | None, stem: bool, dense: Any = None,
                 storage: str | None = None) -> None:
        import faiss

        faiss.omp_set_num_threads(1)
        self.shard_id, self.dim, self.stem, self.dense, self.storage = shard_id, dim, stem, dense, storage
        self.data_dir = Path(data_dir) if data_dir else None
        self.incarnation = uuid.uuid4().hex
        self.state: ShardState | None = None
        self.table: dict = {}
        self._lock = threading.Lock()  # Ray's call thread and the direct channel's threads

    def load(self, committed: set[str] | None) -> tuple[str, bool, Any]:
        """(Re)build the shard: snapshot + committed log records.

        :returns: ``(incarnation, ok, StatsReply with lexical stats and replayed | error text)``.
        """
        try:
            state = ShardState(self.shard_id, self.dim, self.data_dir, stem=self.stem, dense=self.dense,
                               storage=self.storage)
            replayed = state.load(committed)
            ready = state.stats(StatsRequest(lexical=True))
            ready.replayed = replayed
        except Exception as exc:  # noqa: BLE001 - reported to the frontend
            return self.incarnation, False, f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.state, self.table = state, op_table(state)
        return self.incarnation, True, _dumps(ready)

    def ping(self) -> tuple[str, bool, str]:
        """``(incarnation, loaded, node id)``."""
        import ray

        return self.incarnation, self.state is not None, ray.get_runtime_context().get_node_id()

    def _run(self, op: Any, req: Any) -> tuple[bool, Any]:
        with self._lock:
            if self.state is None:
                return False, "shard actor restarted and not loaded yet"
            try:
                self.state.install_finished()  # (no idle loop: a finished background build first)
                return True, dispatch(self.table, op, req)
            except Exception as exc:  # noqa: BLE001 - a bad request never kills the shard
                return False, f"{type(exc).__name__}: {exc}"

    def call(self, blob: bytes) -> tuple[bool, Any]:
        """One pickled ``(Op, request)``. :returns: ``(True, pickled reply)`` or ``(False, error)``."""
        ok, res = self._run(*pickle.loads(blob))
        return ok, _dumps(res) if ok else res

    def open_channel(self) -> tuple[str, int, bytes]:
        """Listen on this node's address for the frontend's direct channel: the pipe
        protocol (``(request_id, op, request)`` -> ``(request_id, ok, reply)``) over TCP,
        authenticated with a fresh random key (``multiprocessing.connection``, HMAC).

        :returns: ``(host, port, authkey)``.
        """
        from multiprocessing.connection import Listener

        import ray

        key = os.urandom(32)
        listener = Listener((ray.util.get_node_ip_address(), 0), authkey=key)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return listener.address[0], listener.address[1], key

    def _accept(self, listener: Any) -> None:
        while True:
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake: wait for the next
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        while True:
            try:
                req_id, op, req = conn.recv()
            except (EOFError, OSError):
                return
            conn.send((req_id, *self._run(op, req)))


class RayPlacement:
    """Connects to Ray, owns the placement group, and makes one :class:`RayTransport` per shard
    (it is the ``transport`` factory of :class:`~.pool.ShardPool`).

    :param cfg: a :class:`~oprag_server.config.RayConfig` (address, strategy, max_restarts,
        shard_cpus, ping_s). :param n: shards. :param replicas: replicas per shard (one bundle
        each; replica ``r`` of shard ``i`` in bundle ``r * n + i``, so SPREAD puts a shard's
        replicas on different nodes when there are enough, STRICT_SPREAD always).
    """

    def __init__(self, cfg: Any, n: int, replicas: int = 1) -> None:
        self.cfg, self.n, self.replicas = cfg, n, replicas
        self.pg: Any = None
        self._lock = threading.Lock()

    def connect(self, timeout_s: float = 120.0) -> Any:
        """``ray.init`` (unless connected) and the placement group, once (blocking). :raises
        RuntimeError: Ray is not installed, or the bundles cannot be placed in time."""
        with self._lock:
            try:
                import ray
                from ray.util.placement_group import placement_group
            except ImportError as exc:
                raise RuntimeError("--ray-address needs Ray: pip install 'oprag[ray]'") from exc
            if not ray.is_initialized():
                env = {"env_vars": {k: "1" for k in _THREAD_VARS}}
                if self.cfg.address == "local":
                    embed = self.cfg.embed_cpus * (1 if self.cfg.embed_actors < 0 else self.cfg.embed_actors)
                    cpus = max(os.cpu_count() or 1, int(self.n * self.replicas * self.cfg.shard_cpus + embed + 0.999))
                    # Ray starts workers at nice 15 by default: behind everything on a busy machine
                    _init_on_keeper_thread(ray, num_cpus=cpus, runtime_env=env, include_dashboard=False,
                                           log_to_driver=False, _system_config={"worker_niceness": 0})
                else:
                    ray.init(address=self.cfg.address, runtime_env=env, log_to_driver=False)
                _LOCAL.started = self.cfg.address == "local"
            _LOCAL.users.add(self)
            if self.pg is None:
                nb = self.n * self.replicas
                pg = placement_group([{"CPU": self.cfg.shard_cpus}] * nb, strategy=self.cfg.strategy)
                if not pg.wait(timeout_s):
                    raise RuntimeError(f"Ray could not place {nb} shard bundles of {self.cfg.shard_cpus} CPU "
                                       f"({self.cfg.strategy}) within {timeout_s:.0f} s")
                self.pg = pg
            return ray

    def new_actor(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool, dense: Any = None,
                  replica: int = 0, storage: str | None = None) -> Any:
        """A shard actor in bundle ``replica * n + shard_id`` of the placement group (``dense``:
        its DenseConfig)."""
        ray = self.connect()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(ShardActor).options(
            num_cpus=self.cfg.shard_cpus, max_restarts=self.cfg.max_restarts, max_task_retries=0,
            max_concurrency=1, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=replica * self.n + shard_id))
        # absolute: an actor does not run in the frontend's working directory
        return cls.remote(shard_id, dim, str(Path(data_dir).resolve()) if data_dir else None, stem, dense, storage)

    def __call__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> "RayTransport":
        return RayTransport(shard_id, dim, data_dir, stem, placement=self)

    def release(self) -> None:
        """Remove the placement group; the last placement of a Ray instance this process
        started (``"local"``) stops it."""
        if self not in _LOCAL.users:
            return
        import ray

        _LOCAL.users.discard(self)
        if self.pg is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        self.pg = None
        if _LOCAL.started and not _LOCAL.users:
            ray.shutdown()
            _LOCAL.started = False


class _LOCAL:  # placements connected in this process; did one of them start Ray?
    users: set = set()
    started = False


class RayTransport(ShardTransport):
    """One shard actor. A failed or timed-out ping (every ``ping_s``), a failed call, a closed
    channel or a new incarnation (Ray restarted it) marks the shard down: its pending calls fail
    with :class:`ShardError`, :meth:`is_alive` is False and the supervisor revives it."""

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
        self._chan: PipeTransport | None = None  # the direct channel (channel="direct")

    # -- life cycle -------------------------------------------------------------------------
    def start(self, committed: set[str] | None) -> None:
        self.actor = self.placement.new_actor(self.shard_id, self.dim, self.data_dir, self.stem, self.dense,
                                              self.replica, self.storage)
        self._load_ref = self.actor.load.remote(set() if committed is None else committed)

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
        if self.placement.cfg.channel == "direct":
            from multiprocessing.connection import Client

            host, port, key = ray.get(self.actor.open_channel.remote(), timeout=timeout_s)
            if self._chan is not None:
                self._chan.hangup()
            self._chan = PipeTransport(self.shard_id, self.dim, None)
            self._chan.attach(Client((host, port), authkey=key), loop)
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
                self._load_ref = self.actor.load.remote(set() if committed is None else committed)
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
        if self._chan is not None:  # wake its reader (a lost node sends no FIN): it fails its calls
            self._chan.hangup()
        loop = self.loop
        pending, self._pending = self._pending, set()
        if loop is not None and not loop.is_closed():
            for fut in pending:
                loop.call_soon_threadsafe(_fail, fut, f"shard {self.shard_id} is down: {why}")

    # -- calls ------------------------------------------------------------------------------
    def call(self, op: Op, request: Any) -> asyncio.Future:
        if self._chan is not None and self._alive:
            return self._chan.call(op, request)
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
        return self._alive and (self._chan is None or self._chan.is_alive())

    def kill(self) -> None:
        """End the actor for good (no Ray restart)."""
        self._mark_down("killed")
        import ray

        if self.actor is not None and ray.is_initialized():  # (a Ray API call would start one)
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
