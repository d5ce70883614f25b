"""Durability evidence: kill -9 crash trials during ingest, shard-kill trials under query load,
and a soak of mixed ingest and queries.

From the repository root (needs ``psutil``: ``pip install -e ".[bench]"``):

    python -m bench.durability --json                     # 20 crash trials, 5 shard kills, 10-minute soak
    python -m bench.durability --quick --json             # smoke: 3 crash trials, 1 shard kill, 1-minute soak

Prints one JSON object last with: crash_trials, acked_docs_lost, half_applied_streams,
shard_kill_trials, silent_partial_results, recovery_s_p50 (shard restart to first complete
answer), shard_chunks, soak_minutes, soak_requests, soak_errors (statuses other than deliberate
RESOURCE_EXHAUSTED refusals), rss_growth_fraction (server process tree, end vs after warm-up).
Percentiles are nearest-rank (``_common.percentile``). A kill -9 of the whole service is
``ServerProcess.kill9()`` (SIGKILL to the server's process group: frontend and shards at once).
"""

from __future__ import annotations

import argparse
import random
import shutil
import threading
import time

import grpc

from oprag_client.client import Doc, OpRAGClient

from ._common import REPO, emit_json, log, machine_info, percentile, require, start_server

OUT = REPO / "bench" / "out" / "durability"


def _tree(pid: int) -> list:
    """The process and all its descendants (``psutil.Process`` objects)."""
    import psutil

    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def _stream_docs(sid: str, n: int) -> list[Doc]:
    return [Doc(f"{sid}d{i}", f"Durability record {sid}d{i}: the keeper logged wind and tide {i}.",
                metadata={"stream": sid}) for i in range(n)]


def _count(c: OpRAGClient, sid: str) -> int:
    hits = c.retrieve("keeper logged wind and tide", mode="dense", top_k=50, filters={"stream": sid}).hits
    return len({h.doc_id for h in hits})


def crash_trials(n: int, rng: random.Random) -> dict:
    lost = half = 0
    recovery = []
    for trial in range(n):
        d = OUT / f"crash-{trial}"
        shutil.rmtree(d, ignore_errors=True)
        srv = start_server(d, "--generator", "none", log_path=OUT / "crash.log")
        acked, attempted, stop = [], [], threading.Event()

        def writer():
            with OpRAGClient(srv.target, timeout=60) as c:
                s = 0
                while not stop.is_set():
                    sid, k = f"c{trial}s{s}", rng.randint(1, 15)
                    attempted.append((sid, k))
                    try:
                        c.ingest(_stream_docs(sid, k))
                    except grpc.RpcError:
                        return
                    acked.append((sid, k))
                    s += 1

        t = threading.Thread(target=writer)
        t.start()
        end = time.time() + 120
        while not acked and time.time() < end:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 3.0))
        srv.kill9()
        stop.set()
        t.join(60)
        t0 = time.perf_counter()
        srv.start()
        recovery.append(time.perf_counter() - t0)
        try:
            with OpRAGClient(srv.target, timeout=60) as c:
                done = {sid for sid, _ in acked}
                for sid, k in acked:
                    lost += k - _count(c, sid)
                for sid, k in attempted:
                    if sid not in done and _count(c, sid) not in (0, k):
                        half += 1
        finally:
            srv.stop()
        log(f"crash trial {trial}: {len(acked)} acknowledged streams, lost so far {lost}, half-applied {half}")
    return {"crash_trials": n, "acked_docs_lost": lost, "half_applied_streams": half,
            "restart_s_p50": round(percentile(recovery, 50), 2)}


def shard_kill_trials(n: int, docs: int) -> dict:
    import psutil

    d = OUT / "shardkill"
    srv = start_server(d, "--generator", "none", "--shards", "2", log_path=OUT / "shardkill.log")
    silent = 0
    recov = []
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            st = c.stats()
            if st.documents < docs:
                log(f"ingesting {docs} short documents for the shard-kill trials")
                for b in range(st.documents, docs, 500):
                    c.ingest([Doc(f"sk{i}", f"Harbour record {i} lists tide {i % 97} and wind {i % 13}.")
                              for i in range(b, min(docs, b + 500))], timeout=900)
                srv.stop()  # snapshot, so restarts load a snapshot like a long-running shard would
                srv.start()
            chunks = c.stats().shards[0].chunks
            for trial in range(n):
                shards = [p for p in psutil.Process(srv.proc.pid).children()
                          if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]
                victim = shards[trial % len(shards)]
                t0 = time.perf_counter()
                victim.kill()
                back = None
                while time.perf_counter() - t0 < 120:
                    try:
                        r = c.retrieve("harbour tide wind", mode="dense", top_k=20)
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        continue
                    if r.retrieval.partial:
                        continue
                    if len(r.hits) < 20:
                        silent += 1
                    if c.health() == "SERVING" and time.perf_counter() - t0 > 0.5:
                        back = time.perf_counter() - t0
                        break
                recov.append(back if back is not None else float("inf"))
                log(f"shard-kill trial {trial}: recovered in {recov[-1]:.2f} s")
    finally:
        srv.stop()
    return {"shard_kill_trials": n, "silent_partial_results": silent,
            "recovery_s_p50": round(percentile(recov, 50), 2), "recovery_s_max": round(max(recov), 2),
            "shard_chunks": chunks}


def soak(minutes: float, rng: random.Random) -> dict:
    d = OUT / "soak"
    shutil.rmtree(d, ignore_errors=True)
    srv = start_server(d, "--generator", "none", "--queue-capacity", "64", log_path=OUT / "soak.log")
    errors = requests = refused = 0
    stop = threading.Event()
    lock = threading.Lock()

    def count(err: grpc.RpcError | None) -> None:
        nonlocal errors, requests, refused
        with lock:
            requests += 1
            if err is not None:
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1
                else:
                    errors += 1
                    log(f"soak error: {err.code().name}: {err.details()}")

    def writer():
        with OpRAGClient(srv.target, timeout=60) as c:
            s = 0
            while not stop.is_set():
                try:
                    c.ingest(_stream_docs(f"soak{s % 50}", rng.randint(1, 20)))  # replaces as it cycles
                    if s % 7 == 0:
                        c.delete([f"soak{(s + 3) % 50}d0"])
                    count(None)
                except grpc.RpcError as exc:
                    count(exc)
                s += 1

    def reader():
        with OpRAGClient(srv.target, timeout=60) as c:
            while not stop.is_set():
                try:
                    c.retrieve("keeper wind tide", mode=rng.choice(["hybrid", "full_hybrid", "lexical"]), top_k=5)
                    count(None)
                except grpc.RpcError as exc:
                    count(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    warm = min(60.0, minutes * 60 / 4)
    time.sleep(warm)
    rss0 = sum(p.memory_info().rss for p in _tree(srv.proc.pid))
    time.sleep(max(0.0, minutes * 60 - warm))
    rss1 = sum(p.memory_info().rss for p in _tree(srv.proc.pid))
    stop.set()
    for t in threads:
        t.join(120)
    alive = srv.alive()
    srv.stop()
    return {"soak_minutes": minutes, "soak_requests": requests, "soak_errors": errors, "soak_refused": refused,
            "soak_server_alive": alive, "rss_after_warmup_mb": round(rss0 / 2**20, 1),
            "rss_end_mb": round(rss1 / 2**20, 1), "rss_growth_fraction": round(rss1 / rss0 - 1, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crash-trials", type=int, default=20)
    ap.add_argument("--shard-kills", type=int, default=5)
    ap.add_argument("--shard-docs", type=int, default=20000, help="documents (one chunk each) for shard kills")
    ap.add_argument("--soak-minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    require("psutil", what="the durability benchmark")
    if a.quick:
        a.crash_trials, a.shard_kills, a.shard_docs, a.soak_minutes = 3, 1, 2000, 1.0
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.time()
    res = {"machine": machine_info()}
    res.update(crash_trials(a.crash_trials, rng))
    res.update(shard_kill_trials(a.shard_kills, a.shard_docs))
    res.update(soak(a.soak_minutes, rng))
    res["wall_s"] = round(time.time() - t0, 1)
    if a.json:
        emit_json(res)
    else:
        for k, v in res.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
