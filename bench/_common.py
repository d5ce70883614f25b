"""Shared helpers for the OpRAG benchmarks in ``bench/``.

* :func:`start_server`: a real ``python -m oprag_server`` subprocess on free ports through the
  launcher the integration tests use (:class:`oprag_client.testing.ServerProcess`); stop it with
  ``.stop()`` (SIGTERM: the server snapshots its shards and exits) or ``.kill9()``.
* :func:`scrape` (+ :func:`mval`, :func:`msum`, :func:`mdelta`): the server's ``/metrics``.
* :func:`require`: check a bench's optional dependencies before its first step.
* Corpus loading (SciFact + WikiText-2 through the client loaders), chunk counting with the
  server's chunker, ingest through the gRPC streaming API, reading the shard snapshots
  (``<data-dir>/shard-N/chunks.arrow``).
* Latency summaries (:func:`percentile`: nearest rank, the one definition of every bench),
  machine information, logging to stderr and the final ``--json`` line.

Everything here uses the public client package, the server's command line, its metrics
endpoint and its documented snapshot format; the few server internals the baselines need (the
same chunker, analyzer and models) come through ``bench/_internals.py`` only.
Run benches as modules from the repository root, e.g. ``python -m bench.retrieval --quick``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

from oprag_client.evaluate import percentile as _nearest_rank
from oprag_client.testing import ServerProcess

from . import _internals

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


# ------------------------------------------------------------------------------ optional imports

def require(*modules: str, extra: str = "bench", what: str = "this benchmark") -> None:
    """Exit with an install hint unless every module in ``modules`` imports.

    Call before a bench's first step, so a missing baseline library fails in a second, not after
    the ingest. :raises SystemExit: naming the missing modules and ``pip install -e ".[extra]"``.
    """
    import importlib

    missing = []
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise SystemExit(f"{what} needs {', '.join(missing)}: install the benchmark extras with "
                         f'pip install -e ".[{extra}]" (from the repository root)')


# ------------------------------------------------------------------------------ stats

def shard_probe_args(ap, *, queries: int, shards: bool = False) -> None:
    """The options every in-process probe of a ``bench.scale`` data dir shares (shard_parts,
    delta_cost, hybrid_probe): the data dir, its dense index, one shard (or ``--shards``), the
    shared data, the query count and a cache file of their vectors."""
    ap.add_argument("--data-dir", type=Path, required=True, help="bench.scale data dir (read, never written)")
    ap.add_argument("--dense-index", default="hnsw")
    if shards:
        ap.add_argument("--shards", type=int, default=2)
    else:
        ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--queries", type=int, default=queries)
    ap.add_argument("--vectors", default="", help="cache file of the query vectors (.npy)")


def served_args(ap, *, queries: int = 100) -> None:
    """The options every bench that serves a built data dir over gRPC shares (served_marks,
    served_trace, rss_probe): the data dir, its dense index, the shard count, the query count."""
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--queries", type=int, default=queries)


def percentile(values: Sequence[float], p: float) -> float:
    """THE percentile of every benchmark: nearest rank (``oprag_client.evaluate.percentile``).

    The value at 1-based rank ``ceil(p / 100 * n)`` of the ascending sorted values (clamped to
    ``[1, n]``), so it is always one of the measured values; no interpolation. ``p`` in
    [0, 100]; 0.0 for an empty list (callers that want ``None`` test emptiness first).
    Source: the nearest-rank method, e.g. NIST/SEMATECH e-Handbook 7.2.5.2 / Wikipedia
    "Percentile". (``numpy.percentile``'s default is linear interpolation: do not use it here.)
    """
    return _nearest_rank(list(values), p)


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
    info.update(idle_policy())
    from importlib import metadata

    for dist in ("torch", "faiss-cpu", "numpy", "grpcio", "rank-bm25", "transformers", "pyarrow",
                 "langchain", "langchain-community", "langchain-classic", "langchain-core"):
        try:
            info[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return info


def idle_policy() -> dict:
    """How this machine's idle CPUs wake (session 29: it moves a 12K Retrieve's p50 by ~10%):
    ``cpuidle_driver`` and ``guest_halt_poll_ns`` (KVM guests' haltpoll; 0: an idle vCPU halts at
    once) from sysfs, and ``cpu_latency_target_us``, the effective CPU latency QoS target
    (``/dev/cpu_dma_latency``: 0 while some process, e.g. ``oprag serve --cpu-latency-us 0``,
    holds a 0 us request; 2e9 = none); each left out where it cannot be read."""
    out: dict = {}
    for key, path in (("cpuidle_driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
                      ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns")):
        try:
            with open(path) as f:
                v = f.read().strip()
            out[key] = int(v) if v.isdigit() else v
        except OSError:
            pass
    from oprag_server.cpu_latency import read_target

    if (target := read_target()) is not None:
        out["cpu_latency_target_us"] = target
    return out


# ------------------------------------------------------------------------------ server

def start_server(data_dir: Path, *extra: str, log_path: Path | None = None, env: dict | None = None,
                 timeout: float = 300.0) -> ServerProcess:
    """Start ``python -m oprag_server --data-dir data_dir extra...`` on free ports through the
    shared launcher (:class:`oprag_client.testing.ServerProcess`), from the repository root,
    output appended to ``log_path``; returns the running server."""
    return ServerProcess.on_free_ports(data_dir, *extra, log_path=log_path, env=env, cwd=REPO).start(timeout)


def scrape(metrics_port: int, timeout: float = 10.0) -> dict[tuple[str, tuple], float]:
    """Every sample of the server's Prometheus ``/metrics`` (``http://127.0.0.1:PORT/metrics``).

    :returns: ``{(sample name, sorted ((label, value), ...)): value}``; read it with
        :func:`mval`, :func:`msum` and :func:`mdelta`.
    :raises OSError: the endpoint did not answer within ``timeout`` s.
    """
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout) as f:
        txt = f.read().decode("utf-8")
    out: dict = {}
    for fam in text_string_to_metric_families(txt):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def mval(m: dict, name: str, **labels) -> float:
    """The sample ``name`` with exactly ``labels`` in a :func:`scrape` result; 0.0 when absent."""
    return float(m.get((name, tuple(sorted(labels.items()))), 0.0))


def msum(m: dict, name: str, **labels) -> float:
    """Sum over every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return float(sum(v for (n, lab), v in m.items() if n == name and want <= set(lab)))


def mdelta(after: dict, before: dict, name: str, **labels) -> float:
    """``mval(after, ...) - mval(before, ...)``: the growth of a counter between two scrapes."""
    return mval(after, name, **labels) - mval(before, name, **labels)


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


def count_chunks(docs: Iterable, size: int = 256, overlap: int = 0) -> int:
    """Chunks the server's chunker makes of ``docs`` (before any re-split of chunks longer than
    the embedder's token limit, which can only add chunks)."""
    return sum(1 for d in docs for p in _internals.chunk_text(d.text, size, overlap) if p.strip())


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
    """Every chunk of every shard's current snapshot (``chunks.arrow`` and the files ``meta.json``'s ``chunk_files``
    lists after it, Arrow IPC streams; see :func:`shard_snapshot_files`).

    :returns: ``{"chunk_id", "doc_id", "title", "text": list[str], "vectors": float32[N, D],
        "shard": list[int]}`` in shard order, then the snapshot's row order.
    :raises ValueError: a snapshot without vectors (one an HNSW server wrote).
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
        meta = f.parent / "meta.json"  # (format 5: chunks.arrow may be followed by more files, listed there)
        names = [e[0] for e in json.loads(meta.read_text()).get("chunk_files") or []] if meta.exists() else []
        tables = []
        for g in [f.parent / n for n in names] or [f]:
            with pa.OSFile(str(g), "rb") as src:
                tables.append(pa.ipc.open_stream(src).read_all())
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        for col in ("chunk_id", "doc_id", "title", "text"):
            out[col] += [x or "" for x in table.column(col).to_pylist()]
        out["shard"] += [shard] * table.num_rows
        if "vector" not in table.column_names:
            raise ValueError(f"{f} has no vector column: {data_dir} was last served with --dense-index hnsw, which "
                             "keeps the vectors in the graph's file; serve it once with --dense-index flat (or ivf)")
        col = table.column("vector").combine_chunks()
        dim = col.type.list_size
        vecs.append(np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, dim))
    out["vectors"] = np.ascontiguousarray(np.concatenate(vecs), dtype=np.float32)
    return out


def hotpath_queries(snap: dict, n: int, seed: int = 0) -> tuple:
    """``bench.hotpath``'s queries from a :func:`read_snapshot` dict: ``n`` distinct stored
    chunks (seeded choice), each vector plus N(0, 0.05^2) noise renormalised (float32[n, D])
    and the chunk's first 200 characters as the query text."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = rng.choice(len(snap["vectors"]), n, replace=False)
    Q = snap["vectors"][rows] + 0.05 * rng.standard_normal((n, snap["vectors"].shape[1])).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    return Q, [snap["text"][r][:200] for r in rows]


#: the query generators of :func:`probe_texts` (``--query-source``)
QUERY_SOURCES = ("scifact", "wikitext", "scifact-sentences", "terms", "term", "passages", "nonwords")


def probe_texts(source: str, n: int, shared: Path = DEFAULT_SHARED, seed: int = 0) -> list[str]:
    """``n`` query texts built by one of several rules, so that a quality figure measured with
    them does not rest on one query set (the vectors are the texts' MiniLM vectors, as a user's):

    * ``scifact``: the first ``n`` judged SciFact train queries (what the benches send);
    * ``wikitext``: sentences of WikiText-2 ``valid.txt`` (split at `` . ``, 8-40 tokens, no
      heading), a seeded sample: real corpus text, so the query's own chunk and the derived
      chunks that reuse its sentences (``bench.scale``) compete near the top;
    * ``scifact-sentences``: sentences of SciFact abstracts (split at ``. ``, 8-40 words), a
      seeded sample;
    * ``terms``: 2-4 words of the corpora's vocabulary (lower-cased alphabetic tokens of 4+
      letters that occur in 3 to 2,000 paragraphs or abstracts), drawn uniformly: keyword
      queries whose BM25 side the dense side does not mirror;
    * ``term``: one such word: the dense side's vector of a lone word is furthest from any chunk's;
    * ``passages``: 60-200 words: a run of consecutive sentences of one WikiText paragraph or
      SciFact abstract, its words shuffled within each sentence (long queries, real vocabulary,
      no verbatim copy of a chunk);
    * ``nonwords``: 1-3 strings of 3-10 random letters: no chunk holds a query term (the BM25 list
      is empty), and the vector sits far from every chunk's (the hardest case for an ANN).

    :raises ValueError: an unknown ``source``.
    """
    import json
    import random
    import re

    if source == "scifact":
        judged, _ = load_queries_qrels(shared, "train")
        return list(judged.values())[:n]
    rng = random.Random(seed)
    wiki = [ln.strip() for ln in (Path(shared) / "data" / "wikitext-2" / "valid.txt").read_text("utf-8").splitlines()
            if ln.strip() and not ln.strip().startswith("=")]
    abstracts = [json.loads(ln)["text"] for ln in (scifact_dir(shared) / "corpus.jsonl").read_text("utf-8").splitlines()
                 if ln.strip()]
    if source in ("wikitext", "scifact-sentences"):
        paras, sep = (wiki, " . ") if source == "wikitext" else (abstracts, ". ")
        sents = [s.strip() for p in paras for s in p.split(sep) if 8 <= len(s.split()) <= 40]
        return rng.sample(sents, min(n, len(sents)))
    if source in ("terms", "term"):
        df: dict[str, int] = {}
        for p in wiki + abstracts:
            for w in set(re.findall(r"[a-z]{4,}", p.lower())):
                df[w] = df.get(w, 0) + 1
        vocab = sorted(w for w, c in df.items() if 3 <= c <= 2000)
        lo, hi = (2, 4) if source == "terms" else (1, 1)
        return [" ".join(rng.sample(vocab, rng.randint(lo, hi))) for _ in range(n)]
    if source == "nonwords":
        abc = "abcdefghijklmnopqrstuvwxyz"
        return [" ".join("".join(rng.choice(abc) for _ in range(rng.randint(3, 10))) for _ in range(rng.randint(1, 3)))
                for _ in range(n)]
    if source == "passages":
        out = []
        paras = [(p, " . ") for p in wiki] + [(p, ". ") for p in abstracts]
        while len(out) < n:
            p, sep = paras[rng.randrange(len(paras))]
            sents = [s.split() for s in p.split(sep) if s.strip()]
            start, words, picked = rng.randrange(len(sents)), 0, []
            for s in sents[start:]:
                rng.shuffle(s)
                picked.append(" ".join(s))
                words += len(s)
                if words >= 60:
                    break
            if 60 <= words <= 200:
                out.append(" . ".join(picked))
        return out
    raise ValueError(f"unknown query source {source!r}: use one of {', '.join(QUERY_SOURCES)}")
