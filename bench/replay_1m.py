"""Crash replay at scale (issue 13, snap15): how long a server of ``--data``'s size (the 1M-chunk
``bench.scale`` data dir) takes to serve again after a kill -9 that left ``--add`` acknowledged
chunks in the shards' write-ahead logs only, against a clean restart of the same data, and
whether every acknowledged document is back.

Steps, on a copy of the data dir (``--copy-from``; never run it on a dir another server serves):

1. *clean start*: the server starts on the snapshot (empty logs); restart-to-serving = from the
   process's start to its ``OPRAG READY`` line, and to the first answered Retrieve;
2. one small ingest, then wait until both shards logged the periodic snapshot it leads to
   (``shard i: snapshot written``): the frontend's snapshot loop then waits at least 30 s
   (``Runtime._snapshot_loop``: 9x a snapshot's time at 1M) before it looks again, so what
   follows stays in the logs only;
3. ``--add`` one-chunk documents with supplied vectors (``bench.scale.derived``: real chunk texts
   reshuffled, real vectors perturbed), ``--per-stream`` per Ingest call; the ids of the
   acknowledged ones are kept; a snapshot logged meanwhile is reported (it would shorten the log);
4. kill -9 of the whole service (frontend and shards: one process group) right after the last
   acknowledgement;
5. *replay start*: the same two times; the shards' READY reports how many log records they
   replayed (``shard i ... replayed``, logged by the frontend); then the chunk count (Stats) must
   be the clean count + ``--add``, and ``--check`` acknowledged documents picked at random must
   each be found (dense Retrieve with the document's own vector, filtered to its ``rid``) --
   every acknowledged document is looked up when ``--check 0``;
6. the index catch-up time from READY (``ann_pending``: deferred HNSW inserts of the replayed
   vectors, reported at READY too), then a clean stop
   (a snapshot) and a clean restart of the grown data dir, timed and checked again.

Command (from the repository root, under the bench lock; the copy is ~5 GB, deleted at the end
unless ``--keep``)::

    flock /work/wt/bench.lock timeout 1800 python -m bench.replay_1m \\
        --copy-from /work/main/bench/out/scale-1000000-hnsw --add 20000 --json
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

from ._common import OUT, emit_json, log, machine_info, read_snapshot

_SNAP = re.compile(r"shard (\d+): snapshot written in ([\d.]+) s")


def _args(a) -> list[str]:
    return ["--generator", "none", "--shards", str(a.shards), "--dense-index", a.dense_index,
            "--monitor-fraction", "0"]


def _serve(a, srv) -> dict:
    """Start ``srv``; seconds to READY and to the first answered Retrieve, the tree's RSS."""
    from oprag_client.client import OpRAGClient, query_request

    from .scale import tree_rss

    t = time.perf_counter()
    srv.start(timeout=1800)
    ready = time.perf_counter() - t
    with OpRAGClient(srv.target, timeout=600) as c:
        c.stub.Retrieve(query_request("lighthouse keeper", top_k=10, query_vector=a.probe))
        first = time.perf_counter() - t
        st = c.stats()
    return {"ready_s": round(ready, 2), "first_retrieve_s": round(first, 2), "chunks": int(st.chunks),
            "documents": int(st.documents), "rss_bytes": tree_rss(srv.proc.pid),
            "ann_pending": sum(int(getattr(s, "ann_pending", 0)) for s in st.shards), "t_ready": t + ready}


def _wait_snapshots(srv, since: int, n: int, limit_s: float = 300.0) -> list[float]:
    """Wait until ``n`` shard snapshot lines appeared after output line ``since``; their times."""
    t = time.perf_counter()
    while True:
        got = [float(m.group(2)) for line in list(srv.lines)[since:] if (m := _SNAP.search(line))]
        if len(got) >= n or time.perf_counter() - t > limit_s:
            return got
        time.sleep(0.2)


def _check(srv, acked: dict[int, list[float]], k: int) -> dict:
    """Look up ``k`` acknowledged documents (all of them when 0) by their own vector and rid."""
    from oprag_client.client import OpRAGClient, query_request

    rids = sorted(acked) if k <= 0 else random.Random(7).sample(sorted(acked), min(k, len(acked)))
    missing = []
    t = time.perf_counter()
    with OpRAGClient(srv.target, timeout=600) as c:
        for rid in rids:
            r = c.stub.Retrieve(query_request("replay", top_k=1, mode="dense", query_vector=acked[rid],
                                              filters={"rid": rid}))
            if not r.hits or r.hits[0].doc_id != f"replay:{rid}":
                missing.append(rid)
    return {"checked": len(rids), "missing": len(missing), "missing_ids": missing[:20],
            "check_s": round(time.perf_counter() - t, 1)}


def main(argv=None) -> int:
    from oprag_client.client import Doc, OpRAGClient
    from oprag_client.testing import ServerProcess

    from .scale import _caught_up, derived

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copy-from", type=Path, default=None, help="data dir to copy to --data first (not served!)")
    ap.add_argument("--data", type=Path, default=OUT / "replay-1m", help="the data dir served (a copy)")
    ap.add_argument("--source", type=Path, default=Path("/work/main/bench/out/retrieval-data"),
                    help="data dir of a finished bench.retrieval run (real chunks and vectors to derive from)")
    ap.add_argument("--add", type=int, default=20_000, help="chunks acknowledged after the last snapshot")
    ap.add_argument("--per-stream", type=int, default=2000)
    ap.add_argument("--check", type=int, default=500, help="acknowledged documents looked up (0: all)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--dense-index", default="hnsw")
    ap.add_argument("--keep", action="store_true", help="keep the copy")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res: dict = {"machine": machine_info(), "load_before": os.getloadavg()[0], "add": a.add}
    if a.copy_from is not None:
        shutil.rmtree(a.data, ignore_errors=True)
        t = time.perf_counter()
        subprocess.run(["cp", "-a", str(a.copy_from), str(a.data)], check=True)
        res["copy_s"] = round(time.perf_counter() - t, 1)
        log(f"copied {a.copy_from} in {res['copy_s']} s")
    snap = read_snapshot(a.source)
    a.probe = snap["vectors"][0].tolist()
    srv = ServerProcess.on_free_ports(a.data, *_args(a), log_path=OUT / "replay-1m-server.log", cwd=Path.cwd())
    try:
        res["clean"] = _serve(a, srv)
        log(f"clean start: {res['clean']}")
        with OpRAGClient(srv.target, timeout=3600) as c:
            mark = len(srv.lines)
            c.ingest([Doc("replay:marker", "a marker written before the periodic snapshot", vector=a.probe)])
            res["snapshot_before_s"] = _wait_snapshots(srv, mark, a.shards)  # the loop's next look is >= 30 s away
            log(f"periodic snapshot done: {res['snapshot_before_s']}")
            mark, acked, i, t = len(srv.lines), {}, 0, time.perf_counter()
            blocks = derived(snap, a.add, 0.5, seed=123, block=a.per_stream)
            for texts, vecs in blocks:
                docs = [Doc(f"replay:{i + j}", text, metadata={"rid": i + j}, vector=v)
                        for j, (text, v) in enumerate(zip(texts, vecs))]
                c.ingest(docs)
                acked.update((i + j, v.tolist()) for j, v in enumerate(vecs))
                i += len(docs)
            res["ingest_s"] = round(time.perf_counter() - t, 1)
        srv.kill9()  # right after the last acknowledgement
        res["snapshots_during_ingest"] = [float(m.group(2)) for line in list(srv.lines)[mark:]
                                          if (m := _SNAP.search(line))]
        log(f"{len(acked)} chunks acknowledged in {res['ingest_s']} s, then kill -9 "
            f"(snapshots meanwhile: {res['snapshots_during_ingest']})")
        res["replay"] = _serve(a, srv)
        res["replay"]["recovered_lines"] = [line.strip() for line in list(srv.lines) if "recovered" in line][:4]
        res["replay"]["expected_chunks"] = res["clean"]["chunks"] + 1 + len(acked)
        res["replay"].update(_check(srv, acked, a.check))
        log(f"replay start: {res['replay']}")
        with OpRAGClient(srv.target, timeout=3600) as c:  # (from READY: the checks ran meanwhile)
            _caught_up(c)
            res["replay"]["index_caught_up_s"] = round(time.perf_counter() - res["replay"]["t_ready"], 1)
        t = time.perf_counter()
        srv.stop(timeout=1800)
        res["stop_s"] = round(time.perf_counter() - t, 1)
        res["clean_after"] = _serve(a, srv)
        res["clean_after"].update(_check(srv, acked, 100))
        log(f"clean restart after the replay: {res['clean_after']}")
    finally:
        srv.kill9()  # (nothing left to keep: the copy is deleted; no snapshot write at the end)
        res["load_after"] = os.getloadavg()[0]
        if not a.keep:
            shutil.rmtree(a.data, ignore_errors=True)
    for k in ("clean", "replay", "clean_after"):
        res.get(k, {}).pop("t_ready", None)
    log(res)
    if a.json:
        emit_json(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
