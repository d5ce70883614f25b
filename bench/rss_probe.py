"""Where a served data dir's RSS goes, by process and mapping, before and after each kind of
query pass (issue 13: "1M chunks served: RSS of the process tree <= 8 GiB").

The server is started on ``--data-dir`` (a copy: it is snapshotted at stop), then, per phase
(``restart``: ready, no query yet; then one pass per ``--phases`` entry, ``hybrid`` /
``full_hybrid`` / ``interleaved``: SciFact train queries with their MiniLM vectors, c = 1), every
process of the tree is read from ``/proc/<pid>/status`` (``RssAnon``, ``RssFile``, ``RssShmem``,
bytes) and ``/proc/<pid>/smaps``: file-backed resident bytes per file name (snapshot files by
base name), anonymous resident bytes in mappings of >= 64 MiB (by size) and in the rest, plus the
shards' ``Stats`` bytes by component. Each pass row also has client p50 (ms) and the server
tree's CPU ms per request; ``hits_sha256`` digests every reply's hits (ids and scores, in order)
to compare two trees' replies. ``--ingest N`` first adds N derived chunks and waits for the
shards' periodic snapshot of them (phase ``after_snapshot``: the state of a server that ingested,
as ``bench.scale`` measures it).

    python -m bench.rss_probe --data-dir bench/out/d1m --phases hybrid,full_hybrid,interleaved --json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import time
from collections import defaultdict
from pathlib import Path

from ._common import DEFAULT_SHARED, OUT, emit_json, load_queries_qrels, log, percentile, served_args, start_server

_BIG = 64 << 20  # an anonymous mapping this large is reported on its own


def smaps_split(pid: int) -> dict:
    """Resident bytes of ``pid``: ``status`` (RssAnon / RssFile / RssShmem), ``file`` {base name:
    bytes} and ``anon_big`` [(mapping size, resident) bytes] for anonymous mappings >= 64 MiB,
    ``anon_small`` (resident bytes of the other anonymous mappings, heap and stacks included)."""
    st = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
            st[k] = int(v.split()[0]) * 1024
    files: dict[str, int] = defaultdict(int)
    big, small = [], 0
    name, size = "", 0
    hdr = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = hdr.match(line)
        if m:
            size = int(m.group(2), 16) - int(m.group(1), 16)
            name = m.group(3).strip()
            continue
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
            if not rss:
                continue
            if name.startswith("/") and not name.startswith("/dev/") and not name.startswith("/memfd"):
                files[Path(name).name] += rss
            elif size >= _BIG:
                big.append((size, rss))
            else:
                small += rss
    return {"status": st, "file": {k: v for k, v in sorted(files.items(), key=lambda x: -x[1]) if v >= 1 << 20},
            "anon_big": sorted(big, reverse=True), "anon_small": small}


def tree(pid: int) -> list[int]:
    """``pid`` then its descendants by pid."""
    import psutil

    root = psutil.Process(pid)
    return [pid, *sorted(p.pid for p in root.children(recursive=True))]


def snapshot(pid: int, label: str, c) -> dict:
    """One phase's reading of the whole tree (see the module docstring)."""
    procs = {}
    for p in tree(pid):
        try:
            procs[str(p)] = smaps_split(p)
        except OSError:
            pass
    stats = [{k: int(getattr(s, f"{k}_bytes")) for k in ("postings", "terms", "vectors", "ann", "chunks")}
             for s in c.stats().shards]
    tot = {k: sum(x["status"].get(k, 0) for x in procs.values()) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    log(f"{label}: {({k: round(v / 2**30, 2) for k, v in tot.items()})} GiB")
    return {"label": label, "tree": tot, "procs": procs, "stats_bytes": stats}


def _log_lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines()) if path.exists() else 0


def _snapshots_after(path: Path, mark: int, shards: int, limit_s: float = 600.0) -> float:
    """Seconds until every shard logged a ``snapshot written`` line after line ``mark`` of the
    server log (the periodic snapshot of what was ingested, at most ``limit_s``)."""
    t = time.perf_counter()
    while time.perf_counter() - t < limit_s:
        lines = path.read_text(errors="replace").splitlines()[mark:]
        if len({m.group(1) for m in map(re.compile(r"shard (\d+): snapshot written").search, lines) if m}) >= shards:
            break
        time.sleep(1.0)
    return time.perf_counter() - t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    served_args(ap)
    ap.add_argument("--phases", default="hybrid,full_hybrid,interleaved")
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--ingest", type=int, default=0,
                    help="derived chunks to ingest first (bench.serve_passes --ingest), then wait for the shards' "
                         "snapshot of them (phase after_snapshot)")
    ap.add_argument("--source", type=Path, default=Path("bench/out/retrieval-data"),
                    help="bench.retrieval data dir --ingest derives from")
    ap.add_argument("--vectors", default=str(OUT / "rss-probe-queries.npy"), help="query vector cache (.npy)")
    ap.add_argument("--lock", default="", help="a file to flock around the query passes (shared machine)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_client.client import OpRAGClient, query_request

    from . import _internals
    from .scale import tree_cpu

    judged, _ = load_queries_qrels(a.shared, "train")
    texts = [judged[x] for x in list(judged)[: a.queries]]
    vecs = _internals.query_vectors(texts, a.vectors)
    out: dict = {"data_dir": str(a.data_dir), "queries": len(texts), "phases": []}
    log_path = OUT / "rss-probe.log"
    srv = start_server(a.data_dir, "--generator", "none", "--shards", str(a.shards), "--dense-index", a.dense_index,
                       "--monitor-fraction", "0", log_path=log_path)
    try:
        with OpRAGClient(srv.target, timeout=600) as c:
            out["phases"].append(snapshot(srv.proc.pid, "restart", c))
            if a.ingest:
                from .serve_passes import _ingest, _settled

                mark = _log_lines(log_path)
                out["ingest"] = _ingest(c, a)
                _settled(c)
                out["snapshot_wait_s"] = round(_snapshots_after(log_path, mark, a.shards), 1)
                out["phases"].append(snapshot(srv.proc.pid, "after_snapshot", c))
            lock = open(a.lock, "a") if a.lock else None
            if lock is not None:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)
            digest = hashlib.sha256()  # every reply's hits (chunk id, scores) in order: old vs new trees
            for ph in a.phases.split(","):
                modes = ("hybrid", "full_hybrid") if ph == "interleaved" else (ph,)
                lat: dict[str, list[float]] = {m: [] for m in modes}
                cpu0 = tree_cpu(srv.proc.pid)
                for text, v in zip(texts, vecs):
                    for mode in modes:
                        t = time.perf_counter()
                        r = c.stub.Retrieve(query_request(text, top_k=10, mode=mode, query_vector=v.tolist()))
                        lat[mode].append((time.perf_counter() - t) * 1e3)
                        digest.update(repr([(h.chunk_id, h.score, h.dense_score, h.lexical_score)
                                            for h in r.hits]).encode())
                row = snapshot(srv.proc.pid, ph, c)
                row["p50_ms"] = {m: round(percentile(x, 50), 2) for m, x in lat.items()}
                row["cpu_ms_per_request"] = round((tree_cpu(srv.proc.pid) - cpu0) * 1e3 / (len(texts) * len(modes)), 2)
                row["load"] = round(os.getloadavg()[0], 2)
                log(f"  p50 {row['p50_ms']} cpu/req {row['cpu_ms_per_request']} ms load {row['load']}")
                out["phases"].append(row)
            out["hits_sha256"] = digest.hexdigest()
            if lock is not None:
                lock.close()
    finally:
        srv.stop()
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
