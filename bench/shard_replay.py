"""One shard's CPU per request, in process, on the requests a served frontend really sent
(issue 13 hot path, shard side).

``capture``: a server (``--generator none``, 2 shards, server defaults plus ``--server-arg``)
from ``--tree`` on a copy of ``--data-dir``; the ``bench.hotpath`` queries (chunk vector + noise,
the chunk's first 200 characters) in ``--mode`` at c=1; every query-path request (search, exact
rounds, fetch) each shard process receives is written to ``--out`` as the frame the pipe
carried (``(id, op, request)`` pickled, the request pickled inside once as the frontend does),
through a ``sitecustomize`` on the server's path (no change to the tree).

``replay``: shard ``--shard`` of ``--data-dir`` loaded in this process from a copy (the source
tree is whatever ``PYTHONPATH`` names: run it once per tree); every captured frame of that
shard unpickled, dispatched (the shard's op table) and its reply pickled, ``--passes`` times;
thread CPU ms per request: the whole, unpickling the frame, the op, pickling the reply, and
exclusive parts of ``search`` (wrapped methods). Replies of every request are hashed (pickled
bytes) so two trees can be compared: ``reply_digest`` must match.

    python -m bench.shard_replay capture --data-dir bench/out/retrieval-data --tree . --out /tmp/cap
    PYTHONPATH=<tree>/server:<tree>/client:. python -m bench.shard_replay replay --data-dir ... --frames /tmp/cap
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import pickle
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from ._common import emit_json, hotpath_queries, log, read_snapshot

_SITE = textwrap.dedent('''
    import os, pickle
    from oprag_server.shards import worker as _w
    from oprag_server.shards import transport as _t
    from oprag_server.shards.protocol import Op as _Op
    _orig = _w.run
    def _run(shard_id, conn, *a, **kw):
        out = open(os.path.join(os.environ["OPRAG_CAPTURE"], f"shard-{shard_id}.frames"), "ab")
        disp = _w.dispatch
        def rec(table, op, req):
            if op in (_Op.SEARCH, _Op.EXACT_MINMAX, _Op.EXACT_LISTS, _Op.FETCH):
                inner = _t._Pickled(pickle.dumps(req, protocol=5)) if op is not _Op.FETCH else req
                body = pickle.dumps((1, op, inner), protocol=5)
                out.write(len(body).to_bytes(4, "big") + body)
                out.flush()
            return disp(table, op, req)
        _w.dispatch = rec
        return _orig(shard_id, conn, *a, **kw)
    _w.run = _run
''')


def capture(a) -> dict:
    from oprag_client.client import OpRAGClient, query_request
    from oprag_client.testing import ServerProcess

    snap = read_snapshot(a.data_dir)
    Q, texts = hotpath_queries(snap, a.queries)
    a.out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp())
    data = Path(tempfile.mkdtemp()) / "data"
    shutil.copytree(a.data_dir, data)
    (site / "sitecustomize.py").write_text(_SITE)
    tree = a.tree.resolve()
    env = {"PYTHONPATH": f"{site}:{tree}/server:{tree}/client:{tree}", "OPRAG_CAPTURE": str(a.out.resolve())}
    srv = ServerProcess.on_free_ports(data, "--generator", "none", "--shards", "2", *a.server_arg, env=env).start()
    try:
        with OpRAGClient(srv.target) as c:
            for t, q in zip(texts, Q):
                c.stub.Retrieve(query_request(t, top_k=10, mode=a.mode, query_vector=q.tolist()))
    finally:
        srv.stop()
        shutil.rmtree(site, ignore_errors=True)
        shutil.rmtree(data.parent, ignore_errors=True)
    return {f.name: f.stat().st_size for f in a.out.iterdir()}


def _frames(path: Path) -> list[bytes]:
    b, out, i = path.read_bytes(), [], 0
    while i < len(b):
        n = int.from_bytes(b[i:i + 4], "big")
        out.append(b[i + 4:i + 4 + n])
        i += 4 + n
    return out


#: (object: "search" | "store" | "postings" | "fields" | "fusion", method, label)
PARTS = [
    ("search", "_kernel_tops", "dense step (int8 scan, refine, minimum)"),
    ("postings", "score", "BM25 of the candidates"),
    ("search", "_lexical_top", "BM25 top-m list (+ its dense scores)"),
    ("search", "_skyband_slots", "skyband (+ cone)"),
    ("search", "_fields", "stored fields"),
    ("store", "ids", "chunk ids"),
    ("search", "_canonical", "canonical scores"),
    ("search", "exact_minmax", "exact min-max round"),
    ("search", "exact_lists", "exact lists round"),
    ("mod", "listed_top", "listed_top (BM25 top-m kernel + glue)"),
    ("mod", "top_k_order", "top_k_order"),
    ("mod", "skyband", "skyband kernel (fusion.skyband)"),
    ("i8", "scores", "int8 scan"),
    ("search", "fetch", "fetch (hit_fields)"),
    ("search", "_dense_min_estimate", "dense-minimum sample estimate"),
]


def replay(a) -> dict:
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    import faiss
    from threadpoolctl import threadpool_limits

    from oprag_server.shards import state as state_mod
    from oprag_server.shards.state import ShardState, dispatch, op_table

    faiss.omp_set_num_threads(1)
    threadpool_limits(1)
    frames = _frames(a.frames / f"shard-{a.shard}.frames")
    tmp = Path(tempfile.mkdtemp())
    try:
        shutil.copytree(a.data_dir / f"shard-{a.shard}", tmp / f"shard-{a.shard}")
        st = ShardState(a.shard, read_snapshot(a.data_dir)["vectors"].shape[1], tmp)
        st.load()
        st.search.warm()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    acc: collections.Counter = collections.Counter()
    stack: list = []
    from oprag_server.index import kernels_scan
    from oprag_server.shards import search as search_mod
    objs = {"search": st.search, "store": st.store, "postings": st.store.postings, "mod": search_mod,
            "i8": kernels_scan.Int8Rows}

    def wrap(obj, name, label):
        f = getattr(obj, name, None)
        if f is None:
            return

        def timed(*args, **kw):
            t = time.thread_time_ns()
            stack.append(0)
            try:
                return f(*args, **kw)
            finally:
                dt = time.thread_time_ns() - t
                inner = stack.pop()
                acc[label] += dt - inner
                if stack:
                    stack[-1] += dt
        setattr(obj, name, timed)

    if a.parts:
        for o, name, label in PARTS:
            wrap(objs[o], name, label)
    table = op_table(st)  # after wrapping: the table holds the wrapped bound methods
    _ = state_mod
    ops = collections.Counter()
    runs = []
    digest = None
    for p in range(a.passes + 1):  # pass 0 warms
        acc.clear()
        h = hashlib.sha256()
        tot = un = op_t = pk = 0
        for fr in frames:
            t0 = time.thread_time_ns()
            _, op, req = pickle.loads(fr)
            t1 = time.thread_time_ns()
            rep = dispatch(table, op, req)
            t2 = time.thread_time_ns()
            body = pickle.dumps((1, True, rep), protocol=pickle.HIGHEST_PROTOCOL)
            t3 = time.thread_time_ns()
            un, op_t, pk, tot = un + t1 - t0, op_t + t2 - t1, pk + t3 - t2, tot + t3 - t0
            h.update(body)
            if p == 0:
                ops[op.value] += 1
        if p == 0:
            digest = h.hexdigest()
            continue
        n = len(frames)
        runs.append({"total_ms": round(tot / n / 1e6, 4), "unpickle_ms": round(un / n / 1e6, 4),
                     "op_ms": round(op_t / n / 1e6, 4), "pickle_ms": round(pk / n / 1e6, 4),
                     "parts_ms": {k: round(v / n / 1e6, 4) for k, v in acc.most_common()}})
        log(f"pass {p}: {runs[-1]}")
    return {"frames": len(frames), "ops": dict(ops), "chunks": len(st.store.dense), "reply_digest": digest,
            "runs": runs, "load": round(os.getloadavg()[0], 2), "python": sys.version.split()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["capture", "replay"])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--tree", type=Path, default=Path("."))
    ap.add_argument("--out", type=Path, default=Path("bench/out/shard-frames"))
    ap.add_argument("--frames", type=Path, default=Path("bench/out/shard-frames"))
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--mode", default="hybrid")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--parts", action="store_true", help="also exclusive CPU of the search's parts")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = capture(a) if a.what == "capture" else replay(a)
    if a.json:
        emit_json(out)
    else:
        log(str(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
