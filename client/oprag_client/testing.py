"""Start a real OpRAG server as a subprocess: the one launcher of the integration tests and the
benchmarks (``bench/``).

:class:`ServerProcess` runs ``python -m oprag_server --port P --metrics-port M --data-dir D
[extra...]`` with the current interpreter, reads its combined stdout/stderr on a thread and
treats the line starting with ``OPRAG READY`` as "serving". The server runs in its own process
group, so :meth:`ServerProcess.kill9` takes the shard processes down with the frontend.

This module imports nothing from ``oprag_server``: the server is only reached through its command
line, its gRPC port and its metrics port, so the client package keeps working without the
server's dependencies installed (the subprocess needs them, of course).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["READY_PREFIX", "ConnectAttempts", "OtlpSink", "ServerProcess", "free_port", "oprag_cli", "wait_until"]

READY_PREFIX = "OPRAG READY"
_KEEP_LINES = 2000  # output lines kept in memory (the log file, when given, keeps all)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oprag_cli() -> list[str]:
    """The argv prefix that runs the ``oprag`` command line of this interpreter's environment:
    the installed console script when present, else ``python -m oprag_client.cli_entry`` (its entry point)."""
    exe = Path(sys.executable).parent / "oprag"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "oprag_client.cli_entry"]


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.1) -> bool:
    """Poll ``pred()`` every ``interval`` seconds; True as soon as it is true, False after
    ``timeout`` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


class ServerProcess:
    """A real OpRAG server subprocess (``python -m oprag_server``).

    :param data_dir: the server's ``--data-dir`` (created on :meth:`start`).
    :param port: gRPC port; ``None`` picks a free one.
    :param metrics_port: Prometheus ``/metrics`` port; ``None`` picks a free one (never ``port``).
    :param extra: further server arguments, e.g. ``"--generator", "none", "--shards", "2"``.
    :param log_path: when given, every output line is appended there (with a header per start).
    :param env: variables added to ``os.environ`` for the subprocess; ``HF_HUB_OFFLINE=1`` unless
        set.
    :param cwd: working directory of the subprocess (default: the caller's).

    :meth:`start` may be called again after :meth:`stop` or :meth:`kill9` (same ports, same data
    directory): that is a restart. ``stop`` is idempotent and safe in ``finally``; the object is
    also a context manager (start on enter, stop on exit).
    """

    #: ``launcher(argv, env, cwd)`` -> an object with ``subprocess.Popen``'s ``pid``, ``stdout``
    #: (text, stdout and stderr together), ``poll``, ``wait``, ``returncode``, ``send_signal`` and
    #: ``kill``, started in a new session; or None to use ``subprocess.Popen``. The test suite
    #: sets it to fork servers from a pre-imported process (``tests/server_zygote.py``).
    launcher: Callable[[list[str], dict[str, str], str | None], Any] | None = None

    def __init__(self, data_dir: Path | str, port: int | None = None, metrics_port: int | None = None,
                 *extra: str, log_path: Path | str | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        while self.metrics_port == self.port:
            self.metrics_port = free_port()
        self.extra = tuple(extra)
        self.log_path = Path(log_path) if log_path else None
        self.env = dict(env or {})
        self.cwd = str(cwd) if cwd else None
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.ready_seen = False
        self._pump_thread: threading.Thread | None = None
        self._log_f = None

    @classmethod
    def on_free_ports(cls, data_dir: Path | str, *extra: str, **kw) -> ServerProcess:
        """``ServerProcess(data_dir, None, None, *extra, **kw)``: both ports picked free."""
        return cls(data_dir, None, None, *extra, **kw)

    @property
    def target(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The argv that :meth:`start` runs."""
        return [sys.executable, "-m", "oprag_server", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--data-dir", str(self.data_dir), *self.extra]

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Start the server and wait up to ``timeout`` s for its ``OPRAG READY`` line.

        :raises RuntimeError: the process exited or did not become ready in time (it is stopped;
            the message holds the last 50 output lines).
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_f = open(self.log_path, "a", encoding="utf-8")
            self._log_f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.command())}\n")
            self._log_f.flush()
        self._ready = threading.Event()
        self.ready_seen = False
        self.lines = []
        env = {**os.environ, **self.env}
        env.setdefault("HF_HUB_OFFLINE", "1")
        t0 = time.time()
        launched = type(self).launcher(self.command(), env, self.cwd) if type(self).launcher else None
        self.proc = launched or subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=self.cwd,
            start_new_session=True,  # its own process group: kill9() takes the shard processes too
        )
        self._pump_thread = threading.Thread(target=self._pump, args=(self.proc, self._ready, self.lines),
                                             daemon=True)
        self._pump_thread.start()
        if not self._ready.wait(timeout) or not self.ready_seen or self.proc.poll() is not None:
            tail = "".join(self.lines[-50:])
            self.stop()
            raise RuntimeError(f"server did not become ready in {time.time() - t0:.0f} s:\n{tail}")
        return self

    def _pump(self, proc: subprocess.Popen, ready: threading.Event, lines: list[str]) -> None:
        assert proc.stdout
        log_f = self._log_f
        for line in proc.stdout:
            lines.append(line)
            if len(lines) > _KEEP_LINES:
                del lines[: _KEEP_LINES // 2]
            if log_f:
                try:
                    log_f.write(line)
                    log_f.flush()
                except ValueError:  # closed by stop() while the last lines drain
                    log_f = None
            if line.startswith(READY_PREFIX):
                self.ready_seen = True
                ready.set()
        ready.set()  # output ended (the process exited): start() stops waiting

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (the server snapshots its shards and exits), SIGKILL after ``timeout`` s.

        :returns: the exit status, or ``None`` when it was never started.
        """
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    rc = self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    print(f"server pid {self.proc.pid} ignored SIGTERM for {timeout:.0f} s: killing it",
                          file=sys.stderr, flush=True)
                    self.proc.kill()
                    rc = self.proc.wait(10)
            else:
                rc = self.proc.returncode
        self._close_log()
        return rc

    def kill9(self) -> None:
        """SIGKILL the whole service (frontend and shard processes, one process group) at once."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # exited in between
                pass
            self.proc.wait(10)
        self._close_log()

    def restart(self, timeout: float = 300.0) -> ServerProcess:
        """:meth:`stop` (when running), then :meth:`start` on the same ports and data directory."""
        self.stop()
        return self.start(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _close_log(self) -> None:
        if self._log_f:
            if self._pump_thread is not None:
                self._pump_thread.join(2.0)  # let the pump drain the last lines
            try:
                self._log_f.close()
            except OSError:
                pass
            self._log_f = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class OtlpSink:
    """An OTLP/gRPC trace receiver on ``127.0.0.1`` for tests and benches of ``--otlp-endpoint``:
    ``opentelemetry-proto``'s ``TraceService`` servicer on a ``grpc`` server in this process.

    :param keep: keep every received span (:meth:`spans`); False only counts them (:attr:`count`),
        for long benchmark runs.

    Use as a context manager or :meth:`start` / :meth:`stop`; :attr:`endpoint` is the value of
    ``--otlp-endpoint``. Needs ``opentelemetry-proto`` (the server's ``otel`` extra); the import
    happens in :meth:`start`, so this module still imports without it.
    """

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.count = 0
        self.requests = 0
        self._spans: list = []
        self._lock = threading.Lock()
        self._server = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpSink:
        """Bind a free port and serve. :raises ImportError: ``opentelemetry-proto`` is missing."""
        from concurrent.futures import ThreadPoolExecutor

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self

        class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the gRPC method name
                spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
                with sink._lock:
                    sink.requests += 1
                    sink.count += len(spans)
                    if sink.keep:
                        sink._spans.extend(spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="otlp-sink"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def spans(self) -> list:
        """The received ``opentelemetry.proto.trace.v1.Span`` messages, in arrival order."""
        with self._lock:
            return list(self._spans)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(1).wait()
            self._server = None

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ConnectAttempts:
    """A TCP listener on ``127.0.0.1:port`` (0: a free one) that accepts and at once closes every
    connection, noting when: each is one connection attempt of a gRPC client, which fails as it
    would against a port with nothing listening (the attempts a client makes while its server is
    down, and its back-off between them, become visible).

    Use as a context manager or call :meth:`close`; :attr:`target` is ``host:port``.
    :raises OSError: the port cannot be bound.
    """

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))  # (SO_REUSEADDR: a port a server just left)
        self.target = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.times: list[float] = []  # time.monotonic() of each accepted connection
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.times.append(time.monotonic())
            conn.close()

    def gaps(self) -> list[float]:
        """Seconds between consecutive attempts (rounded to 10 ms)."""
        return [round(b - a, 2) for a, b in zip(self.times, self.times[1:])]

    def close(self) -> None:
        """Stop listening. ``shutdown`` first: a thread blocked in ``accept`` keeps a closed socket
        listening on Linux until a connection comes (the port then refused a server started at once
        with "Address already in use"); ``shutdown`` wakes it and releases the port now."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not listening any more (closed already)
            pass
        self.sock.close()

    def __enter__(self) -> ConnectAttempts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
