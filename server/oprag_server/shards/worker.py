"""Shard worker process: owns one FAISS partition, the BM25 postings of its chunks and the
memory records of the sessions routed to it (a :class:`~oprag_server.shards.state.ShardState`).

Spawned by :class:`~oprag_server.shards.transport.PipeTransport`. It answers requests
``(request_id, Op, request)`` with ``(request_id, ok, reply or error text)`` (types in
:mod:`oprag_server.shards.protocol`), one at a time, so every operation is atomic with respect
to queries; except a snapshot (:attr:`Op.SNAPSHOT`), written beside the loop
(:mod:`.snapjob`): meanwhile the loop answers read ops (:data:`.state.READS`) and holds every
other request, in order, until the snapshot's reply is sent. A read may then be answered before
a write sent ahead of it whose reply has not come: the frontend never depends on that order (a
query and a commit's apply exclude each other by the frontend's lock, staged batches are not
read, a memory write is awaited before anything that reads it). Between requests it does deferred work in small steps
(:meth:`~oprag_server.shards.state.ShardState.background_step`: HNSW inserts an ingest left for
later, then a large segment's BM25 wide rows), looking for a request after each step. The first
message is READY: ``(0, True, StatsReply)`` with the full BM25 statistics, or ``(0, False, error)``.

This module imports neither torch nor grpc: shard processes stay small.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path

from ..index.disk_errors import print_failure
from .protocol import Op, SnapshotRequest, StatsRequest
from .state import READS, ShardState, dispatch, op_table


def frame_head(n: int) -> bytes:
    """The length header of an ``n``-byte frame, as :class:`multiprocessing.connection.Connection`
    writes it: 4 bytes big-endian signed, or -1 then 8 bytes for a body over 2 GiB - 1."""
    return n.to_bytes(4, "big", signed=True) if n <= 0x7FFFFFFF else b"\xff\xff\xff\xff" + n.to_bytes(8, "big")


def writev_all(fd: int, parts: list[memoryview]) -> None:
    """Write every byte of ``parts`` (byte views, emptied) to ``fd`` with as few ``writev``
    calls as the descriptor takes (one when it has room). :raises OSError: as ``os.writev``."""
    while parts:
        done = os.writev(fd, parts)
        while parts and done >= len(parts[0]):
            done -= len(parts[0])
            parts.pop(0)
        if parts and done:
            parts[0] = parts[0][done:]


class Pipe:
    """The shard's end of the pipe, framed as :class:`multiprocessing.connection.Connection`
    frames (a 4-byte big-endian length, or -1 and an 8-byte one, then the pickle), read and
    written with fewer system calls: a reply goes out in one ``writev`` (multiprocessing writes a
    frame over 16 KB as two writes, header then body, and the frontend's reader woke for each),
    and requests are read through a buffer (usually one ``read`` per request instead of two).
    Anything else (a connection without a file descriptor) is used as it is."""

    def __init__(self, conn) -> None:
        self.conn, self.fd, self.buf = conn, conn.fileno(), bytearray()

    @classmethod
    def of(cls, conn):
        try:
            conn.fileno()
        except (AttributeError, OSError, ValueError):
            return conn
        return cls(conn)

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.buf) or self.conn.poll(timeout)

    def _frame(self) -> tuple[int, int] | None:
        """``(header bytes, body bytes)`` of the frame at the start of the buffer, once known."""
        buf = self.buf
        if len(buf) < 4:
            return None
        n = int.from_bytes(buf[:4], "big", signed=True)
        if n != -1:
            return 4, n
        return (12, int.from_bytes(buf[4:12], "big")) if len(buf) >= 12 else None

    def recv(self):
        """The next request (:raises EOFError: the pipe closed)."""
        buf = self.buf
        while True:
            f = self._frame()
            if f is not None:
                h, n = f
                if len(buf) >= h + n:
                    body = buf[h:h + n]
                    del buf[:h + n]
                    return pickle.loads(body)
                if n >= 1 << 20:  # a large frame (a write batch): read the rest into its own buffer
                    body = bytearray(n)
                    have = len(buf) - h
                    body[:have] = buf[h:]
                    buf.clear()
                    view = memoryview(body)
                    while have < n:
                        got = os.readv(self.fd, [view[have:]])
                        if not got:
                            raise EOFError
                        have += got
                    view.release()
                    return pickle.loads(body)
            data = os.read(self.fd, 1 << 16)
            if not data:
                raise EOFError
            buf += data

    def send(self, obj) -> None:
        # protocol 5 (Connection.send's ForkingPickler uses the default, 4 on Python 3.11, whose bytearrays
        # reduce to bytearray(bytes) calls): a hybrid reply -8 us to pickle here, -4 us to unpickle on the frontend
        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        writev_all(self.fd, [memoryview(frame_head(len(body))), memoryview(body).cast("B")])


def run(shard_id: int, conn, dim: int, data_dir: str | None, stem: bool, committed: set[str] | None = None,
        dense=None, storage: str | None = None, who: str | None = None) -> None:
    """Process entry point: load the snapshot, report READY with stats, serve requests until
    :attr:`Op.SHUTDOWN` or the pipe closes. A failing request is answered with its error and
    never stops the loop.

    The pipe closes when the frontend exits or dies (``kill -9``): the loop sees it at its next
    read or poll (between requests; a snapshot being written is finished first, :func:`_finish`),
    and the process then ends at once with :func:`os._exit` instead of tearing the interpreter
    down (freeing a large shard's objects took 2-4 s, during which a restarted frontend's new
    shard could start beside it); so does the process after :attr:`Op.SHUTDOWN` (:func:`main`). Nothing acknowledged is cut: a write is acknowledged after its
    prepare record is fsync'ed in the write-ahead log, and every file (snapshot, ``CURRENT``, the
    log's reset) is written to a temporary name and renamed."""
    # the frontend decides when shards stop (a group SIGINT/SIGTERM must not kill them first)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Pipe.of(conn)
    try:
        import faiss

        faiss.omp_set_num_threads(1)
    except Exception:  # pragma: no cover
        pass
    try:
        state = ShardState(shard_id, dim, Path(data_dir) if data_dir else None, stem=stem, dense=dense, storage=storage,
                           who=who)
        state.say(started_line(process_age()))
        replayed = state.load(committed)
        state.say(warm_line(state.search.warm(), process_age()))  # compiled kernels ready before the first query
        ready = state.stats(StatsRequest(lexical=True))
        ready.replayed = replayed
        conn.send((0, True, ready))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, then exit
        conn.send((0, False, f"{type(exc).__name__}: {exc}"))
        return
    table = op_table(state)
    busy = state.background_due()  # deferred work waits (HNSW inserts a replay left, a loaded segment's wide rows)
    job = None  # (request id, SnapshotJob): a snapshot being written beside this loop (.snapjob)
    held: collections.deque = collections.deque()  # requests that wait for it, in order
    while True:
        if job is not None:
            done = _step(conn, job)
            if not done:  # answer reads meanwhile; every other request waits for it, in order
                if not conn.poll(SNAPSHOT_POLL_S):
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    _finish(conn, job)
                    _gone()
                if msg[1] not in READS:  # (a read may pass a held write: see the module docstring)
                    held.append(msg)
                    continue
                _answer(conn, table, *msg)
                continue
            job = None
        if held:
            req_id, op, req = held.popleft()
        else:
            if not conn.poll(0):  # nothing asked
                wait = state.idle_wait()  # idle maintenance (BM25 merges once writes are quiet)
                if wait == 0.0:
                    _timed(state, "idle maintenance", state.idle_step)
                    busy = state.background_due()  # (an installed merge's segment: its wide rows)
                    continue
                if busy:  # do some of the deferred work, then look again
                    busy = _timed(state, "a background step", state.background_step)
                    continue
                if wait is not None and not conn.poll(wait):
                    continue
            try:
                req_id, op, req = conn.recv()
            except (EOFError, OSError):
                _gone()
        if op is Op.SNAPSHOT and type(req) is SnapshotRequest and state.data_dir is not None:
            try:
                job = (req_id, state.snapshot_begin())
            except Exception as exc:  # noqa: BLE001 - answered as any failed request
                _fail(conn, req_id, exc)
            continue
        _timed(state, f"a {op.name} request", _answer, conn, table, req_id, op, req)
        if op is Op.SHUTDOWN:
            break
        state.note()  # (a write-time merge started or installed: logged with its time)
        busy = state.background_due()


def process_age() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time in clock ticks
    after boot against ``/proc/uptime``, 10 ms resolution), or None where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:  # (fields after the parenthesised name: 3 = state, ..., 22 = starttime)
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            return max(0.0, float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def started_line(age: float | None) -> str:
    """The shard's first log line, once its modules are imported (before the snapshot's load):
    on a loaded machine the interpreter's start and the imports took 4-7 s after the frontend
    logged the process's pid, without a line. :param age: :func:`process_age`."""
    took = f" in {age:.1f} s" if age is not None else ""
    return f"process started{took} (Python, numpy, FAISS, numba and the shard's modules imported); loading its data"


def warm_line(warm_s: float, age: float | None) -> str:
    """The shard's line before READY: the search kernels' warm-up (:meth:`.search.Searcher.warm`,
    seconds ``warm_s``) and, with ``age`` (:func:`process_age`), the seconds since the process started."""
    total = f"; ready {age:.1f} s after the process started" if age is not None else ""
    return f"search kernels ready in {warm_s:.1f} s (compiled, or loaded from numba's cache){total}"


def main(*args) -> None:
    """A shard process's entry point: :func:`run` (which returns once it answered SHUTDOWN, its
    snapshot written), then :func:`exit_now`: the interpreter teardown made a server's SIGTERM
    wait 3.5 s with 2 shards, 6-9 s with 2-3 shards x 2 replicas (the frontend joins each process
    in turn). Tests call :func:`run` in their own process, which must go on."""
    _log_lines(args[0], args[8] if len(args) > 8 else None)
    run(*args)
    exit_now(0)


def _log_lines(shard_id: int, who: str | None) -> None:
    """(A shard process) the ``oprag`` logger's WARNINGs and ERRORs (the storage's, :mod:`.storage`) as the shard's
    own lines, ``<local time>,<ms> <LEVEL> shard <i>: ...`` (:meth:`.state.ShardState.say`): with no handler there
    they came out bare, no time, level or shard (trial59b F7)."""
    import logging  # noqa: PLC0415

    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {who or f'shard {shard_id}'}: %(message)s"))
    lg = logging.getLogger("oprag")
    lg.addHandler(h)
    lg.setLevel(logging.WARNING)
    lg.propagate = False


def _gone() -> None:
    """The frontend hung up (the pipe closed) between requests: end the process now (see :func:`run`)."""
    exit_now(0)


def exit_now(status: int) -> None:
    """Flush stdout and stderr, then end the process at once with ``status`` (``os._exit``: no
    interpreter teardown; a shard whose frontend left, or the server's second stop signal,
    :func:`oprag_server.supervision.stop_now`)."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001 - nothing to report to any more
            pass
    os._exit(status)


#: how long the loop waits for a request while a snapshot is written beside it before it looks
#: whether the snapshot is done (the SNAPSHOT reply comes at most this much later)
SNAPSHOT_POLL_S = 0.005


#: a step of the request loop that takes longer than this is logged (session 41: 2.7-4.5 s searches during an ingest
#: left no line to attribute them by)
SLOW_S = 1.0


def _timed(state: ShardState, what: str, fn, *args):
    """``fn(*args)``; logged (``<what> held the request loop <s> s``) when it took over :data:`SLOW_S`."""
    t = time.perf_counter()
    try:
        return fn(*args)
    finally:
        if (dt := time.perf_counter() - t) > SLOW_S:
            state.say(f"{what} held the request loop {dt:.2f} s")


def _answer(conn, table, req_id, op, req) -> None:
    """Answer one request (its error when it fails: never let a bad request kill the shard). A
    frontend that is gone (killed while the shard worked: the pipe is broken) ends the process
    quietly, as between requests (:func:`_gone`), instead of two tracebacks in the log."""
    try:
        reply = dispatch(table, op, req)
    except Exception as exc:  # noqa: BLE001
        _fail(conn, req_id, exc)
        return
    try:
        conn.send((req_id, True, reply))
    except (BrokenPipeError, ConnectionResetError):
        _gone()
    except Exception as exc:  # noqa: BLE001 - a reply that cannot be sent (pickling): its error instead
        _fail(conn, req_id, exc)


def _fail(conn, req_id, exc: Exception) -> None:
    print_failure(exc)  # to the service log (a disk error once: the frontend logs those); the caller gets the message
    try:
        conn.send((req_id, False, f"{type(exc).__name__}: {exc}"))
    except (BrokenPipeError, ConnectionResetError):
        _gone()


def _step(conn, job) -> bool:
    """Advance the snapshot ``job`` ``(request id, SnapshotJob)``; answer it once done (its
    error if it failed). :returns: whether it is over."""
    req_id, j = job
    try:
        out = j.step()
    except Exception as exc:  # noqa: BLE001
        _fail(conn, req_id, exc)
        return True
    if out is None:
        return False
    try:
        conn.send((req_id, True, out))
    except (BrokenPipeError, ConnectionResetError):  # the frontend left meanwhile: the snapshot is written
        _gone()
    return True


def _finish(conn, job) -> None:
    """The frontend hung up during a snapshot: let it end as it would have (its reply unsent)."""
    try:
        job[1].wait()
    except Exception:  # noqa: BLE001 - nobody to tell; the previous snapshot and the log stay
        traceback.print_exc()
