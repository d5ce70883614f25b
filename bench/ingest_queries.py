"""Served queries while an ingest runs (issue 13, session 41: trial40b saw HNSW hybrid queries at p50 214 ms, max
879 ms while 25,000 documents were replaced, and 1.1-2.0 s queries during a first ingest).

The real server (``python -m oprag_server``, ``--generator none``, ``--shards`` shards, ``--dense-index``) on an
empty data dir under ``bench/out``; one thread ingests ``--chunks`` derived one-chunk documents with supplied vectors
(``bench.scale``'s derivation from ``--source``) in streams of ``--per-stream``, then replaces the first
``--replace`` of them (same ids, other derived texts and vectors); the main thread meanwhile sends SciFact train
queries with their MiniLM vectors, hybrid, top_k 10, c = 1, ``--gap-ms`` apart, and keeps on for ``--after`` seconds
once the writes end. Per phase (``first`` ingest by acknowledged chunks: below ``--ann-check``'s default 16,384, up
to twice that, above; ``replace``; ``after``): client p50 / p95 / max, the server's ``timings_ms`` p50, and each query
over ``SLOW_MS`` with its wall-clock end (to line up with the server log ``bench/out/ingest-queries.log``). Also the
ingest's chunks/s.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.ingest_queries --dense-index hnsw --chunks 40000 --replace 20000 --json
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

from . import _internals
from ._common import DEFAULT_SHARED, OUT, emit_json, log, machine_info, percentile, probe_texts, start_server

#: a query slower than this is listed with its end time
SLOW_MS = 250.0


def _writer(c, a, snap: dict, marks: dict) -> None:
    """The ingest, then the replacement; ``marks``: acknowledged chunks so far, the phase, its timings (``error``: what
    ended it early)."""
    try:
        _write(c, a, snap, marks)
    except BaseException as exc:  # noqa: BLE001 - the query loop stops and main reports it
        marks["error"] = exc


def _write(c, a, snap: dict, marks: dict) -> None:
    from oprag_client.client import Doc

    from .scale import derived

    for phase, n, seed in (("first", a.chunks, 29), ("replace", a.replace, 31)):
        t, done = time.perf_counter(), 0
        marks["phase"] = phase
        for texts, vecs in derived(snap, n, 0.5, seed=seed, block=a.per_stream):
            c.ingest([Doc(f"d{done + i}", x, vector=v) for i, (x, v) in enumerate(zip(texts, vecs))])
            done += len(texts)
            marks["acked"] = done if phase == "first" else a.chunks
        marks[phase + "_chunks_per_s"] = round(done / max(1e-9, time.perf_counter() - t))
    marks["phase"] = "after"
    marks["after_t"] = time.perf_counter()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=40_000)
    ap.add_argument("--replace", type=int, default=20_000)
    ap.add_argument("--per-stream", type=int, default=500)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between a reply and the next query")
    ap.add_argument("--after", type=float, default=20.0, help="seconds of queries after the writes end")
    ap.add_argument("--queries", type=int, default=200, help="distinct SciFact train queries, cycled")
    ap.add_argument("--source", type=Path, default=Path("bench/out/retrieval-data"))
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from oprag_client.client import OpRAGClient, query_request

    from ._common import read_snapshot

    snap = read_snapshot(a.source)  # (before the server starts: a source without vectors says so at once)
    texts = probe_texts("scifact", a.queries, a.shared)
    vecs = _internals.encoder("minilm", device="cpu").encode(texts, truncate=True)
    data = OUT / "ingest-queries-data"
    shutil.rmtree(data, ignore_errors=True)
    srv = start_server(data, "--generator", "none", "--shards", str(a.shards), "--dense-index", a.dense_index,
                       "--monitor-fraction", "0", *a.server_arg, log_path=OUT / "ingest-queries.log")
    rows: list[tuple[str, float, dict, str]] = []  # (phase, ms, timings_ms, wall-clock end)
    marks: dict = {"acked": 0, "phase": "first"}
    try:
        with OpRAGClient(srv.target, timeout=600) as c, OpRAGClient(srv.target, timeout=600) as w:
            th = threading.Thread(target=_writer, args=(w, a, snap, marks), daemon=True)
            t0 = time.perf_counter()
            th.start()
            i = 0
            while "error" not in marks and (th.is_alive() or time.perf_counter() - marks.get("after_t", 0.0) < a.after):
                ph = marks["phase"]
                if ph == "first":
                    ph = "first<16K" if marks["acked"] < 16_384 else "first<32K" if marks["acked"] < 32_768 else "first>32K"
                t = time.perf_counter()
                r = c.stub.Retrieve(query_request(texts[i % len(texts)], top_k=10, mode="hybrid",
                                                  query_vector=vecs[i % len(texts)].tolist()))
                rows.append((ph, (time.perf_counter() - t) * 1e3, dict(r.timings_ms), time.strftime("%H:%M:%S")))
                i += 1
                time.sleep(a.gap_ms / 1e3)
            wall = time.perf_counter() - t0
    finally:
        srv.stop()
    if "error" in marks:
        raise SystemExit(f"the writer failed: {marks['error']!r}")
    out: dict = {"dense_index": a.dense_index, "chunks": a.chunks, "replace": a.replace, "wall_s": round(wall, 1),
                 "first_chunks_per_s": marks.get("first_chunks_per_s"),
                 "replace_chunks_per_s": marks.get("replace_chunks_per_s"), "phases": {}, "machine": machine_info()}
    for ph in dict.fromkeys(p for p, *_ in rows):
        ms = [m for p, m, _, _ in rows if p == ph]
        tim: dict[str, list[float]] = {}
        for p, _, tm, _ in rows:
            if p == ph:
                for k, v in tm.items():
                    tim.setdefault(k, []).append(v)
        out["phases"][ph] = {"queries": len(ms), "p50_ms": round(percentile(ms, 50), 2),
                             "p95_ms": round(percentile(ms, 95), 2), "max_ms": round(max(ms), 1),
                             "server_timings_p50_ms": {k: round(percentile(v, 50), 2) for k, v in tim.items()},
                             "slow": [(end, round(m), {k: round(v, 1) for k, v in tm.items()})
                                      for p, m, tm, end in rows if p == ph and m > SLOW_MS][:20]}
        log(ph, {k: v for k, v in out["phases"][ph].items() if k != "slow"})
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
