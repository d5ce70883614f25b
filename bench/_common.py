"""Shared helpers for the OpRAG benchmarks in ``bench/``.

* :class:`Server`: start a real ``python -m oprag_server`` subprocess on free ports, wait for
  ``OPRAG READY``, stop it with SIGTERM (the server snapshots its shards and exits).
* Corpus loading (SciFact + WikiText-2 through the client loaders), chunk counting with the
  server's chunker, ingest through the gRPC streaming API, reading the shard snapshots
  (``<data-dir>/shard-N/chunks.arrow``).
* Latency summaries (nearest-rank percentiles, as ``oprag_client.evaluate.percentile``),
  machine information, logging to stderr and the final ``--json`` line.

Everything here uses only the public client package, the server's command line and its
documented snapshot format; nothing here edits the server.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHARED = (REPO / ".." / "shared").resolve()
OUT = REPO / "bench" / "out"


# ------------------------------------------------------------------------------ output

def log(*args, **kw) -> None:
    """print to stderr (stdout is reserved for the final JSON line)."""
    print(*args, file=sys.stderr, flush=True, **kw)


def emit_json(obj) -> None:
    """Print ``obj`` as ONE JSON line on stdout (the last line of the benchmark's output)."""
    sys.stdout.flush()
    print(json.dumps(obj, sort_keys=False, default=_json_default), flush=True)


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ------------------------------------------------------------------------------ stats

def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (same definition as ``oprag_client.evaluate.percentile``)."""
    from oprag_client.evaluate import percentile as _p

    return _p(list(values), p)


def summarize(latencies_s: Sequence[float], wall_s: float | None = None, digits: int = 3) -> dict:
    """``{"n", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "qps"}`` from per-request seconds.

    ``qps`` is ``n / wall_s`` when the wall time of the whole run is given (the right measure
    under concurrency), else ``n / sum(latencies)`` (sequential runs).
    """
    ms = [x * 1000.0 for x in latencies_s]
    n = len(ms)
    total = wall_s if wall_s is not None else sum(latencies_s)
    return {
        "n": n,
        "p50_ms": round(percentile(ms, 50), digits),
        "p95_ms": round(percentile(ms, 95), digits),
        "p99_ms": round(percentile(ms, 99), digits),
        "mean_ms": round(sum(ms) / n, digits) if n else 0.0,
        "qps": round(n / total, 2) if total and n else 0.0,
    }


def machine_info() -> dict:
    """CPU count, load, Python and library versions (whatever is importable)."""
    info: dict = {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    from importlib import metadata

    for dist in ("torch", "faiss-cpu", "numpy", "grpcio", "rank-bm25", "transformers", "pyarrow",
                 "langchain", "langchain-community", "langchain-classic", "langchain-core"):
        try:
            info[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return info


# ------------------------------------------------------------------------------ server

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real OpRAG server subprocess (``python -m oprag_server``).

    Output goes to ``log_path`` (appended), not to the benchmark's stdout. Use as a context
    manager or call :meth:`start` / :meth:`stop` (stop is idempotent and safe in ``finally``).
    """

    def __init__(self, data_dir: Path, *extra: str, port: int | None = None, metrics_port: int | None = None,
                 log_path: Path | None = None, env: dict | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.extra = list(extra)
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        while self.metrics_port == self.port:
            self.metrics_port = free_port()
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._log_f = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "oprag_server", "--port", str(self.port), "--metrics-port",
                str(self.metrics_port), "--data-dir", str(self.data_dir), *self.extra]

    def start(self, timeout: float = 300.0) -> Server:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_f = open(self.log_path, "a", encoding="utf-8")
            self._log_f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.command())}\n")
            self._log_f.flush()
        self._ready = threading.Event()
        self.lines = []
        env = {**os.environ, **(self.env or {})}
        env.setdefault("HF_HUB_OFFLINE", "1")
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=str(REPO))
        threading.Thread(target=self._pump, daemon=True).start()
        t0 = time.time()
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            tail = "".join(self.lines[-40:])
            self.stop()
            raise RuntimeError(f"server did not become ready in {time.time() - t0:.0f} s:\n{tail}")
        return self

    def _pump(self) -> None:
        proc, ready = self.proc, self._ready
        assert proc and proc.stdout
        for line in proc.stdout:
            self.lines.append(line)
            if len(self.lines) > 2000:
                del self.lines[:1000]
            if self._log_f:
                self._log_f.write(line)
                self._log_f.flush()
            if line.startswith("OPRAG READY"):
                ready.set()
        ready.set()

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (the server snapshots and exits), SIGKILL after ``timeout`` s."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    rc = self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log(f"server pid {self.proc.pid} ignored SIGTERM for {timeout:.0f} s: killing it")
                    self.proc.kill()
                    rc = self.proc.wait(10)
            else:
                rc = self.proc.returncode
        if self._log_f:
            time.sleep(0.2)  # let the pump drain the last lines
            try:
                self._log_f.close()
            except Exception:  # noqa: BLE001
                pass
            self._log_f = None
        return rc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------ corpora

def scifact_dir(shared: Path) -> Path:
    return Path(shared) / "data" / "scifact"


def load_corpus(shared: Path = DEFAULT_SHARED, *, scifact: bool = True, wikitext: bool = True) -> list:
    """SciFact corpus + WikiText-2 valid articles as ``oprag_client.client.Doc`` objects."""
    from oprag_client.loaders import load_beir, load_wikitext

    docs: list = []
    if scifact:
        docs += list(load_beir([scifact_dir(shared) / "corpus.jsonl"]))
    if wikitext:
        docs += list(load_wikitext([Path(shared) / "data" / "wikitext-2" / "valid.txt"]))
    return docs


def count_chunks(docs: Iterable, size: int = 900, overlap: int = 0) -> int:
    """Chunks the server's chunker makes of ``docs`` (before any re-split of chunks longer than
    the embedder's token limit, which can only add chunks)."""
    from oprag_server.operators.chunking import chunk_text

    return sum(1 for d in docs for p in chunk_text(d.text, size, overlap) if p.strip())


def load_queries_qrels(shared: Path, split: str = "train") -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """(judged queries {qid: text} in qrels order, qrels {qid: {doc: rel}}) for SciFact."""
    from oprag_client.evaluate import load_qrels, load_queries

    d = scifact_dir(shared)
    queries = load_queries(d / "queries.jsonl")
    qrels = load_qrels(d / "qrels" / f"{split}.tsv")
    judged = {q: queries[q] for q, rels in qrels.items() if q in queries and any(r > 0 for r in rels.values())}
    return judged, qrels


def ingest(client, docs: Sequence, per_stream: int = 500, progress: bool = True) -> dict:
    """Ingest ``docs`` through the gRPC streaming API, ``per_stream`` documents per stream."""
    t0 = time.perf_counter()
    written = chunks = rejected = split = 0
    for i in range(0, len(docs), per_stream):
        r = client.ingest(docs[i:i + per_stream])
        written += r.documents_written
        chunks += r.chunks_written
        rejected += len(r.rejected)
        split += r.chunks_split
        if progress:
            el = time.perf_counter() - t0
            log(f"  ingest {min(i + per_stream, len(docs))}/{len(docs)} docs, {chunks} chunks, {el:.0f} s")
    return {"documents": written, "chunks": chunks, "rejected": rejected, "chunks_split": split,
            "seconds": round(time.perf_counter() - t0, 1)}


def shard_snapshot_files(data_dir: Path) -> list[tuple[int, Path]]:
    """``(shard, chunks.arrow)`` per shard directory, following the server's loading rule:
    ``shard-N/CURRENT`` names the current snapshot directory (``shard-N/snap-*/``); without it a
    snapshot written directly into ``shard-N/`` (the first on-disk layout) is used.
    Warns when a shard's write-ahead log is not empty (records newer than the snapshot)."""
    out = []
    for d in sorted(Path(data_dir).glob("shard-*"), key=lambda p: int(p.name.split("-")[1])):
        cur = d / "CURRENT"
        snap = d / cur.read_text().strip() if cur.exists() else d
        f = snap / "chunks.arrow"
        if not f.exists():
            continue
        wal = d / "wal.log"
        if wal.exists() and wal.stat().st_size > 0:
            log(f"warning: {wal} is not empty: the snapshot may miss records (stop the server cleanly first)")
        out.append((int(d.name.split("-")[1]), f))
    return out


def read_snapshot(data_dir: Path) -> dict:
    """Every chunk of every shard's current snapshot (``chunks.arrow``, Arrow IPC stream; see
    :func:`shard_snapshot_files`).

    :returns: ``{"chunk_id", "doc_id", "title", "text": list[str], "vectors": float32[N, D],
        "shard": list[int]}`` in shard order, then the snapshot's row order.
    """
    import numpy as np
    import pyarrow as pa

    out: dict = {"chunk_id": [], "doc_id": [], "title": [], "text": [], "shard": []}
    vecs = []
    files = shard_snapshot_files(data_dir)
    if not files:
        raise FileNotFoundError(f"no shard snapshot (shard-*/[snap-*/]chunks.arrow) under {data_dir}")
    out["files"] = [str(f) for _, f in files]
    for shard, f in files:
        with pa.OSFile(str(f), "rb") as src:
            table = pa.ipc.open_stream(src).read_all()
        for col in ("chunk_id", "doc_id", "title", "text"):
            out[col] += [x or "" for x in table.column(col).to_pylist()]
        out["shard"] += [shard] * table.num_rows
        col = table.column("vector").combine_chunks()
        dim = col.type.list_size
        vecs.append(np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, dim))
    out["vectors"] = np.ascontiguousarray(np.concatenate(vecs), dtype=np.float32)
    return out
