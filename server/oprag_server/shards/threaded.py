"""Shards on threads of the frontend process (``--shard-workers thread``; shard 0 of ``inline``,
:mod:`.inline`): for small deployments, where a shard's query work (~1 ms) is of the order of what
a process boundary costs (pickling the request and reply, two pipe wake-ups, three processes
taking turns on a few cores).

Each shard is the same :class:`~.state.ShardState` and op table a shard process runs, served by
one thread of its own: requests run one at a time in the order they were sent, exactly as a
shard process reads its pipe, so every operation stays atomic with respect to queries and
writes keep today's durability (the same write-ahead log code: a write is acknowledged after
the shard's log record is on disk) and ordering. The shards' threads run in parallel with each
other and with the event loop wherever the work leaves the GIL (numba ``nogil`` kernels, BLAS,
FAISS). BLAS runs on one thread (``threadpoolctl``), and the kernels are warmed before READY
(:meth:`~.search.Searcher.warm`), as in a shard process. Query requests (search, the exact
rounds, fetch) and their replies are passed as objects (a reply is read-only to the frontend);
every other request and reply goes through a pickle round trip, as through a pipe.

A snapshot (:attr:`~.protocol.Op.SNAPSHOT`) is written beside the shard's thread, as a shard
process writes it (:mod:`.snapjob`): its steps run on the shard's thread between requests, a
helper thread waits for the BM25 merge and the writer thread in between, and meanwhile the read
ops (:data:`.state.READS`) are served as they come while every other request is held, in order,
until the SNAPSHOT is answered. Between requests the shard's thread does a shard process's idle
work (:meth:`ThreadTransport._idle`: deferred HNSW inserts, idle BM25 merges; trial17).

Failure semantics differ from processes: a thread cannot be killed. :meth:`ThreadTransport.kill`
marks the shard down (pending calls fail with :class:`~.transport.ShardError`) and waits for
the operation in progress to end before a replacement loads the snapshot and log; a fault
that ends the process (a native crash, an out-of-memory kill) ends the whole server, where in
process mode the supervisor restarts only that shard. An exception inside an operation is
answered as an error, as a shard process answers it.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import traceback
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from ..index.disk_errors import print_failure
from .gather import Slot
from .protocol import Op, SnapshotReply, StatsReply, StatsRequest
from .snapjob import ShardGone
from .state import READS, ShardState, dispatch, op_table
from .transport import ShardError, ShardTransport
from .worker import warm_line

log = logging.getLogger("oprag")

#: ops whose request and reply cross without a copy (reads; the reply is read-only)
ZERO_COPY = frozenset({Op.SEARCH, Op.EXACT_MINMAX, Op.EXACT_LISTS, Op.FETCH})
_limits_set = threading.Lock()
_limited: list[Any] = []  # the threadpoolctl limiter, kept alive (process-wide, set once)


def one_blas_thread() -> None:
    """Limit numpy's OpenBLAS (not torch's) and FAISS's OpenMP in this process to one thread, as in a shard
    process: two shards scanning at once on two cores must not each start a second BLAS thread
    (oversubscribed, a multi-threaded matrix-vector product was 30x slower than a single-threaded one)."""
    with _limits_set:
        if _limited:
            return
        try:
            import numpy as np
            from threadpoolctl import ThreadpoolController

            ctl = ThreadpoolController()
            numpy_dir = str(Path(np.__file__).parent.parent)
            mine = [lib for lib in ctl.lib_controllers if str(lib.filepath).startswith(numpy_dir)]
            for lib in mine:
                lib.set_num_threads(1)
            _limited.append(mine)
        except Exception as exc:  # noqa: BLE001 - a missing limiter costs speed, not results
            log.warning("could not limit BLAS to one thread for thread shards: %s", exc)
            _limited.append(None)
        try:
            import faiss

            faiss.omp_set_num_threads(1)
        except Exception:  # pragma: no cover
            pass


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (``top -H``, ``/proc/<pid>/task/*/comm``; Linux,
    best effort: 15 bytes at most)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - a name is a convenience
        pass


def _executor(shard_id: int) -> ThreadPoolExecutor:
    """The one thread serving shard ``shard_id`` (named ``oprag-shard-<id>`` for the OS too)."""
    name = f"oprag-shard-{shard_id}"
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_name_os_thread, initargs=(name,))


class ThreadTransport(ShardTransport):
    """One shard served by a thread of this process (same arguments as
    :class:`~.transport.PipeTransport`)."""

    def __init__(self, shard_id: int, dim: int, data_dir: Path | None, stem: bool = False) -> None:
        super().__init__(shard_id, dim, data_dir, stem)
        self.state: ShardState | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._exec: ThreadPoolExecutor | None = None
        self._starting: Future | None = None
        self._table: dict | None = None
        self._alive = False
        self._pending: set[asyncio.Future] = set()
        self._gate = threading.Lock()  # guards _held, _driver
        self._held: list[tuple] | None = None  # while a snapshot is written: the requests it holds, in order
        self._driver: threading.Thread | None = None  # the helper thread of the snapshot being written
        self._queued = 0  # requests submitted and not yet started (idle work waits for none); under _gate
        self._idle_queued = self._timer = False  # an idle step queued on the shard's thread; a timer set
        self._busy = threading.Lock()  # held while the state is used: by the thread's work, or a read run inline

    @classmethod
    def of(cls, state: ShardState) -> "ThreadTransport":
        """Serve a state built by the caller (tests, benches); ready at once, on the loop of
        the first call."""
        t = cls(state.shard_id, state.dim, state.data_dir)
        t.state, t._table, t._alive = state, op_table(state), True
        t._exec = _executor(state.shard_id)
        return t

    def start(self, committed: set[str] | None) -> None:
        one_blas_thread()
        self._exec = _executor(self.shard_id)
        self._starting = self._exec.submit(self._load, set() if committed is None else committed)

    def _load(self, committed: set[str]) -> StatsReply:
        state = ShardState(self.shard_id, self.dim, self.data_dir, stem=self.stem, dense=self.dense,
                           storage=self.storage, who=self.who)
        replayed = state.load(committed)
        state.say(warm_line(state.search.warm(), None))  # compiled kernels ready before the first query (as worker.run)
        ready = state.stats(StatsRequest(lexical=True))
        ready.replayed = replayed
        self.state, self._table = state, op_table(state)
        return ready

    def ready(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> StatsReply:
        assert self._starting is not None, "start() first"
        try:
            res = self._starting.result(timeout_s)
        except FutureTimeout as exc:
            raise ShardError(f"shard {self.shard_id} did not report READY within {timeout_s:.0f} s") from exc
        except Exception as exc:  # noqa: BLE001 - as a shard process reports a failed start
            raise ShardError(f"shard {self.shard_id} failed to start: {type(exc).__name__}: {exc}") from exc
        self.loop, self._alive = loop, True
        self._kick()  # (HNSW inserts a replay left)
        return res

    def _run(self, op: Op, request: Any) -> tuple[bool, Any]:
        """(On the shard's thread) one operation: ``(True, reply)`` or ``(False, error text)``; then :meth:`_kick`."""
        with self._busy:  # (the count drops only once this holds it: no inline read can overtake the request)
            with self._gate:
                self._queued -= 1
            try:
                if op not in ZERO_COPY:
                    request = pickle.loads(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
                reply = dispatch(self._table, op, request)
                if op not in ZERO_COPY:
                    reply = pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                return True, reply
            except Exception as exc:  # noqa: BLE001 - never let a bad request stop the shard
                print_failure(exc)
                return False, f"{type(exc).__name__}: {exc}"
            finally:
                self._kick()

    def _kick(self, timer: bool = False) -> None:
        """Queue one :meth:`_idle` on the shard's thread unless one is queued (``timer``: the timer fired)."""
        with self._gate:
            self._timer = self._timer and not timer
            if self._idle_queued or not self._alive or self._exec is None:
                return
            try:
                self._exec.submit(self._idle)
                self._idle_queued = True
            except RuntimeError:  # shut down
                pass

    def _idle(self) -> None:
        """(On the shard's thread) one step of a shard process's idle work (:func:`.worker.run`) unless a request
        waits or a snapshot is being written: a BM25 merge due now, else deferred HNSW inserts; again while work is
        left, or when a merge's quiet time ends (one loop timer). A failure is logged; the next request retries."""
        with self._gate:
            self._idle_queued = False
            if self._queued or self._held is not None or self.state is None:
                return  # (the request's end, or the snapshot's release, kicks again)
        with self._busy:
            state = self.state
            try:
                wait = state.idle_wait()
                if wait == 0.0 or state.background_due():
                    state.idle_step() if wait == 0.0 else state.background_step()
                    self._kick()
                elif wait is not None and self.loop is not None and not self._timer and not self.loop.is_closed():
                    self._timer = True
                    self.loop.call_soon_threadsafe(self.loop.call_later, wait, self._kick, True)
            except Exception:  # noqa: BLE001 - never let idle work stop the shard's thread
                traceback.print_exc()

    #: answers into a :class:`~.gather.Slot` (``call(..., into=slot)``): see :meth:`ShardPool.gather_partial`
    joins = True

    def call(self, op: Op, request: Any, into: Slot | None = None) -> asyncio.Future | Slot:
        """Send one request; the outcome resolves a new future, or ``into`` (a slot of a
        :class:`~.gather.Gather`, set from the shard's thread: the group's last shard alone
        wakes the loop)."""
        loop = self.loop = self.loop or asyncio.get_running_loop()
        fut = loop.create_future() if into is None else into
        if not self._alive or self._exec is None:
            fut.set_exception(ShardError(f"shard {self.shard_id} is not running"))
            return fut
        if op is Op.SHUTDOWN:
            self._alive = False  # nothing after it is served (a shard process exits)
        elif self._inline(op, request, fut):  # (.inline.InlineTransport: a read served here and now)
            return fut
        with self._gate:
            if self._held is not None and op not in READS:  # a snapshot is being written: after it
                self._held.append((op, request, fut))
            else:
                try:
                    self._submit(op, request, fut)
                except RuntimeError as exc:  # executor shut down
                    fut.set_exception(ShardError(f"shard {self.shard_id} is not running: {exc}"))
                    return fut
        self._pending.add(fut)
        if into is not None:
            into.group.held.append((self._pending, into))
        return fut

    def _inline(self, op: Op, request: Any, fut: asyncio.Future | Slot) -> bool:  # (.inline.InlineTransport: True)
        return False  # (serve ``request`` on the caller's thread instead, setting ``fut``)

    def _submit(self, op: Op, request: Any, fut: asyncio.Future | Slot) -> None:
        """(Under ``_gate``) queue one request on the shard's thread; a SNAPSHOT starts one
        written beside it (:meth:`_snapshot`). :raises RuntimeError: the executor is shut down."""
        assert self._exec is not None
        if op is Op.SNAPSHOT:
            cf = self._snapshot(request)
        else:
            cf = self._exec.submit(self._run, op, request)
            self._queued += 1
        cf.add_done_callback(lambda f: self._done(fut, f))

    def _snapshot(self, request: Any) -> Future:
        """(Under ``_gate``) start a snapshot after the requests queued before it: a helper
        thread steps it on the shard's thread (:meth:`.snapjob.SnapshotJob.drive`); from now
        until its outcome is set, :meth:`call` holds every request but reads."""
        assert self._exec is not None and self.state is not None
        state, cf = self.state, Future()
        first = self._exec.submit(self._excl, state.snapshot_begin)  # (raises RuntimeError when shut down)
        self._held = []
        self._driver = threading.Thread(target=self._drive, args=(first, cf),
                                        name=f"oprag-snapshot-{self.shard_id}", daemon=True)
        self._driver.start()
        return cf

    def _drive(self, first: Future, cf: Future) -> None:
        """(The helper thread) the snapshot to its end, its outcome, then the held requests."""
        try:
            try:
                job = first.result()
            except CancelledError as exc:  # killed before it began
                raise ShardError("the shard stopped before its snapshot began") from exc
            reply = SnapshotReply(written=False) if job is None else job.drive(self._on_shard)
            out: tuple[bool, Any] = (True, pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)))
        except Exception as exc:  # noqa: BLE001 - answered as any failed request
            print_failure(exc)
            out = (False, f"{type(exc).__name__}: {exc}")
        cf.set_result(out)
        self._release()
        self._kick()  # (idle work waited for the snapshot)

    def _on_shard(self, fn):
        """Run ``fn`` on the shard's thread, after the requests queued before it; its result.
        :raises ShardGone: the shard's thread has stopped (then none of it runs any more)."""
        assert self._exec is not None
        try:
            f = self._exec.submit(self._excl, fn)
        except RuntimeError as exc:  # shut down (kill, close)
            gone: BaseException = exc
        else:
            try:
                return f.result()
            except CancelledError as exc:  # dropped by kill
                gone = exc
        self._exec.shutdown(wait=True)  # (nothing of the shard's runs any more after this)
        raise ShardGone from gone

    def _excl(self, fn):  # (on the shard's thread) fn() holding the state: no inline read meanwhile
        with self._busy:
            return fn()

    def _release(self) -> None:
        """(The helper thread, the snapshot answered) queue the held requests in order, up to
        the next SNAPSHOT (which starts and holds the rest)."""
        with self._gate:
            held, self._held, self._driver = self._held or [], None, None
            for i, (op, request, fut) in enumerate(held):
                try:
                    self._submit(op, request, fut)
                except RuntimeError:  # shut down meanwhile: kill/close failed or drop them
                    return
                if op is Op.SNAPSHOT:
                    self._held = held[i + 1:]
                    return

    def _done(self, fut: asyncio.Future | Slot, cf: Future) -> None:
        """(On the shard's thread) hand the outcome to the loop; a slot's outcome is set here,
        and only the last of its group posts to the loop."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            if type(fut) is Slot:
                if fut.group.put(fut.k, self._outcome(cf)):
                    loop.call_soon_threadsafe(fut.group.finish)
                return
            loop.call_soon_threadsafe(self._resolve, fut, cf)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _outcome(self, cf: Future) -> Any:
        """The reply of a finished call, or the :class:`ShardError` it failed with."""
        if cf.cancelled():
            return ShardError(f"shard {self.shard_id} is not running")
        ok, res = cf.result()
        return res if ok else ShardError(f"shard {self.shard_id}: {res}")

    def _resolve(self, fut: asyncio.Future, cf: Future) -> None:
        self._pending.discard(fut)
        if fut.done():
            return
        out = self._outcome(cf)
        if isinstance(out, ShardError):
            fut.set_exception(out)
        else:
            fut.set_result(out)

    def is_alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        """Mark the shard down: queued calls are dropped and every pending call fails; the
        operation in progress (if any) runs to its end first (a thread cannot be stopped), so
        that a replacement never shares the shard's log with it. Blocking."""
        self._alive = False
        self._on_loop(self._fail_pending)
        if self._exec is not None:
            self._exec.shutdown(wait=True, cancel_futures=True)
        self._join_driver()

    def _join_driver(self) -> None:
        """Wait for a snapshot being written to end (its writer resets the shard's log)."""
        with self._gate:
            d = self._driver
        if d is not None and d is not threading.current_thread():
            d.join()

    def _fail_pending(self) -> None:
        pending, self._pending = self._pending, set()
        for fut in pending:
            if not fut.done():
                fut.set_exception(ShardError(f"shard {self.shard_id} is not running"))

    def _on_loop(self, fn) -> None:
        """Run ``fn()`` on the loop's thread: now when this is it, else soon (nothing when the
        loop is gone)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            fn()
        else:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:
                pass

    def close(self) -> None:
        self._alive = False
        if self._exec is not None:
            self._exec.shutdown(wait=True, cancel_futures=False)
        self._join_driver()

