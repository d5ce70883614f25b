"""What an idle gap costs the next request here (issue 13, 12K hot path; session 29).

A parent and one forked worker process exchange a 1-byte request and an 8-byte reply over a
``multiprocessing`` pipe. The worker does nothing (``work 0``) or a shard-sized dense scan
(``work 1``: float32[6000, 384] @ q and an argpartition of the top 256, 9.2 MB read) and reports
its own thread CPU for it. Between requests the parent busy-waits ``gap`` microseconds (its own
core stays busy; the worker's is idle). Reported per (work, gap): round-trip p50 / p95 and the
worker's CPU p50, in microseconds.

``--qos`` holds a CPU latency QoS request of 0 us (``/dev/cpu_dma_latency``, as ``oprag serve
--cpu-latency-us 0`` does; needs root) for the whole run: idle CPUs poll instead of halting.

    python -m bench.idle_probe --json
    python -m bench.idle_probe --qos --json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import struct
import time

import numpy as np

from ._common import emit_json, machine_info


def _worker(conn) -> None:
    rng = np.random.default_rng(0)
    M = rng.standard_normal((6000, 384)).astype(np.float32)
    q = rng.standard_normal(384).astype(np.float32)
    while True:
        m = conn.recv_bytes()
        if m == b"x":
            break
        t = time.thread_time_ns()
        if m == b"w":
            np.argpartition(M @ q, -256)[-256:]
        conn.send_bytes(struct.pack("q", time.thread_time_ns() - t))


def run(work: bool, gap_us: float, n: int, warm: int = 200) -> dict:
    a, b = mp.Pipe()
    p = mp.Process(target=_worker, args=(b,))
    p.start()
    lat, cpu = [], []
    msg = b"w" if work else b"q"
    for i in range(n + warm):
        t = time.perf_counter()
        a.send_bytes(msg)
        w = struct.unpack("q", a.recv_bytes())[0]
        if i >= warm:
            lat.append((time.perf_counter() - t) * 1e6)
            cpu.append(w / 1e3)
        end = time.perf_counter() + gap_us / 1e6
        while time.perf_counter() < end:
            pass
    a.send_bytes(b"x")
    p.join()
    return {"work": int(work), "gap_us": gap_us, "rt_p50_us": round(float(np.median(lat)), 1),
            "rt_p95_us": round(float(np.percentile(lat, 95)), 1), "worker_cpu_p50_us": round(float(np.median(cpu)), 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qos", action="store_true", help="hold /dev/cpu_dma_latency at 0 us during the run")
    ap.add_argument("--gaps", default="0,300,2000", help="idle gaps between requests, microseconds")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from oprag_server.cpu_latency import hold, release

    req = hold(0 if a.qos else -1)
    try:
        rows = [run(bool(w), float(g), a.n) for w in (0, 1) for g in a.gaps.split(",")]
    finally:
        release(req)
    for r in rows:
        print(("qos " if a.qos else "") + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    out = {"qos": a.qos, "rows": rows, "load": round(os.getloadavg()[0], 2), "machine": machine_info()}
    if a.json:
        emit_json(out)
    return out


if __name__ == "__main__":
    main()
