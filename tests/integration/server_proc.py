"""Start a real OpRAG server (real shard processes, real models) as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ServerProcess:
    def __init__(self, data_dir: Path, port: int, metrics_port: int, *extra: str) -> None:
        self.data_dir = data_dir
        self.port = port
        self.metrics_port = metrics_port
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> ServerProcess:
        cmd = [
            sys.executable, "-m", "oprag_server",
            "--port", str(self.port),
            "--metrics-port", str(self.metrics_port),
            "--data-dir", str(self.data_dir),
            *self.extra,
        ]
        self._ready = threading.Event()
        self.lines = []
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ},
            start_new_session=True,  # its own process group: kill9() takes the shard processes too
        )
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-50:]))
        return self

    def _pump(self) -> None:
        proc, ready, lines = self.proc, self._ready, self.lines
        assert proc and proc.stdout
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("OPRAG READY"):
                ready.set()
        ready.set()

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill9(self) -> None:
        """SIGKILL the whole service (frontend and shard processes) at once."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def oprag_cli() -> list[str]:
    exe = Path(sys.executable).parent / "oprag"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "oprag_client.cli"]


def wait_until(pred, timeout: float = 10.0, interval: float = 0.1) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
