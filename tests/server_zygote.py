"""Faster test server starts: ``python -m oprag_server`` forked from a process that has already
imported torch and transformers (a "zygote", as Android and Chromium start their processes).

A quiet start of a test server took ~8 s on the project's 2-core machines, ~6 s of it the
frontend importing torch, transformers and the BERT model code for its embedder; the suite starts
about a hundred. :class:`Zygote` is a child of the pytest process that imports those once
(single-threaded: nothing is run, no thread pool exists yet) and then forks one child per server
start. The child does what ``python -m oprag_server ARGS`` does from there (``runpy`` with
``sys.argv``, the test's environment, working directory and a new session), so the server runs
its whole start-up: shards are still fresh interpreters (``spawn``), models are still loaded and
warmed, data directories replayed. Only the import of modules already in ``sys.modules`` is saved.

:func:`launcher` is what ``tests/conftest.py`` installs as
:attr:`oprag_client.testing.ServerProcess.launcher`: when the command is ``python -m oprag_server
...`` of this interpreter it forks the server from the zygote started with the same variables read
at import time (``OMP_*``, ``MKL_*``, ``PYTHON*`` ...: one zygote per such environment, at most
two kept), else it returns None and the server is started with ``subprocess.Popen`` as before.
``OPRAG_TEST_FORK=0`` turns it off.

The returned :class:`ForkedProcess` has the parts of ``subprocess.Popen`` that the tests use
(``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``,
``kill``); the zygote reaps its children and sends each exit status back on the child's own
connection (the server is not the test process's child, so the test cannot ``waitpid`` it).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

#: environment variables read when a module is imported (or a native library loaded), which a
#: forked child cannot change any more: a start whose environment differs here is not forked
_IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "PYTHON", "LD_", "MALLOC_", "HF_",
                         "TRANSFORMERS_", "TORCH", "TOKENIZERS_", "NUMBA_", "CUDA_", "PYTORCH_")
#: what the zygote imports before it forks (the frontend's own start imports the rest)
_PRELOAD = ("torch", "transformers", "transformers.models.bert.modeling_bert", "numpy", "oprag_server")
_STATUS = struct.Struct("!qi")  # (pid, exit code as subprocess reports it: -N for signal N)


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


# ---------------------------------------------------------------------------- zygote process side
def _child(conn: socket.socket, fds: list[int], req: dict, close: list) -> None:
    """In the forked child: become ``python -m oprag_server ARGS`` and never return. ``close``:
    the zygote's own sockets, selector and file descriptors."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for obj in close:
            obj.close() if hasattr(obj, "close") else os.close(obj)
        os.setsid()  # its own process group, as Popen(start_new_session=True)
        conn.sendall(_STATUS.pack(os.getpid(), 0))  # started: the test may signal its group now
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        conn.close()
        os.environ.clear()
        os.environ.update(req["env"])
        if req["cwd"]:
            os.chdir(req["cwd"])
        sys.argv = ["oprag_server", *req["argv"]]
        sys.path[0] = os.getcwd()  # as `python -m` sets it (the zygote's is tests/)
        import runpy

        try:
            runpy.run_module("oprag_server", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
            import traceback

            traceback.print_exc()
            code = 1
        for t in threading.enumerate():  # interpreter shutdown: non-daemon threads, then atexit
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()  # noqa: SLF001
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def zygote_main() -> None:
    """The zygote: import :data:`_PRELOAD`, print ``READY``, then serve fork requests on the Unix
    socket named by ``argv[1]`` until its stdin (a pipe from the test process) closes."""
    path = sys.argv[1]
    for name in _PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, "the zygote must not start threads before it forks"
    sel = selectors.DefaultSelector()
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(16)
    r_wake, w_wake = os.pipe()
    os.set_blocking(w_wake, False)
    signal.set_wakeup_fd(w_wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel.register(lst, selectors.EVENT_READ, "accept")
    sel.register(r_wake, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    print("READY", flush=True)
    zygote = os.getpid()
    try:
        _serve_forks(sel, lst, r_wake, w_wake)
    finally:  # the socket and the directory the test process made for it go with the zygote
        if os.getpid() != zygote:  # a forked child never gets here (_child ends in os._exit)
            os._exit(1)
        lst.close()
        for leftover in (lambda: os.unlink(path), lambda: os.rmdir(os.path.dirname(path))):
            try:
                leftover()
            except OSError:
                pass


def _serve_forks(sel, lst, r_wake, w_wake) -> None:
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):  # the test process ended
                    return
            elif key.data == "accept":
                conn, _ = lst.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                req = json.loads(msg.decode())
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(conn, fds, req, [lst, sel, r_wake, w_wake, *children.values()])
                for fd in fds:
                    os.close(fd)
                children[pid] = conn  # the child itself says it started (after its setsid)
            else:
                os.read(r_wake, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(_STATUS.pack(pid, os.waitstatus_to_exitcode(status)))
                        except OSError:
                            pass
                        conn.close()


# ---------------------------------------------------------------------------- test process side
class ForkedProcess:
    """A server forked by the zygote, with the ``subprocess.Popen`` methods the tests use."""

    def __init__(self, pid: int, conn: socket.socket, stdout) -> None:
        self.pid, self._conn, self.stdout = pid, conn, stdout
        self.returncode: int | None = None
        self.args = None

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        sel = selectors.DefaultSelector()
        sel.register(self._conn, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            return None
        data = b""
        while len(data) < _STATUS.size:
            got = self._conn.recv(_STATUS.size - len(data))
            if not got:  # the zygote died: the child is gone or no longer ours to watch
                self.returncode = -signal.SIGKILL if not _alive(self.pid) else None
                if self.returncode is None:
                    return self._wait_gone(timeout)
                return self.returncode
            data += got
        self.returncode = _STATUS.unpack(data)[1]
        self._conn.close()
        return self.returncode

    def _wait_gone(self, timeout: float | None) -> int | None:
        end = None if timeout is None else time.monotonic() + timeout
        while _alive(self.pid):
            if end is not None and time.monotonic() > end:
                return None
            time.sleep(0.05)
        self.returncode = -signal.SIGKILL
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._read_status(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(["oprag_server"], timeout)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygote:
    """A zygote process of this test process for one import-time environment (see
    :func:`launcher`), started with the environment ``env``; it ends when this process does."""

    def __init__(self, env: dict[str, str]) -> None:
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="oprag-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.proc.kill()
            raise RuntimeError(f"the test zygote did not start (printed {line!r})")

    def close(self) -> None:
        """End the zygote (its servers keep running; their exit statuses are no longer reported)."""
        self.proc.stdin.close()
        self.proc.wait(30)

    def fork(self, argv: list[str], env: dict[str, str], cwd: str | None) -> ForkedProcess:
        r, w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            msg = json.dumps({"argv": argv[3:], "env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [msg], [null, w, w])
        finally:
            os.close(w)
            os.close(null)
        data = b""
        while len(data) < _STATUS.size:
            got = conn.recv(_STATUS.size - len(data))
            if not got:
                os.close(r)
                raise RuntimeError("the test zygote closed the connection before forking")
            data += got
        pid = _STATUS.unpack(data)[0]
        return ForkedProcess(pid, conn, os.fdopen(r, "r"))


#: zygotes by import-time environment; a test process mostly needs one (a few tests start servers
#: with other thread settings, and importing the server's kernels sets NUMBA_CACHE_DIR)
_zygotes: dict[tuple, Zygote] = {}
_MAX_ZYGOTES = 2
_zygote_lock = threading.Lock()


def launcher(argv: list[str], env: dict[str, str], cwd: str | None) -> ForkedProcess | None:
    """:attr:`oprag_client.testing.ServerProcess.launcher`: fork ``argv`` from the zygote of
    ``env``'s import-time variables (started on first use) when ``argv`` is ``python -m
    oprag_server ...`` of this interpreter; else None (the caller uses ``subprocess.Popen``)."""
    if os.environ.get("OPRAG_TEST_FORK", "1") == "0" or argv[:3] != [sys.executable, "-m", "oprag_server"]:
        return None
    key = tuple(sorted(_import_env(env).items()))
    with _zygote_lock:
        z = _zygotes.get(key)
        if z is None or z.proc.poll() is not None:
            while len(_zygotes) >= _MAX_ZYGOTES:
                _zygotes.pop(next(iter(_zygotes))).close()
            z = _zygotes[key] = Zygote(env)
    return z.fork(argv, env, cwd)


if __name__ == "__main__":
    zygote_main()
