"""Do two shard-like worker processes start together when the frontend wakes them? (issue 13, 12K hot path)

A parent (the frontend) writes one request to each of two forked workers and waits for both replies; each worker
burns ``WORK_MS`` of CPU (a shard's search) and replies with the time it started. Reported: the round's p50 / p90
and the two workers' start skew. ``pipe``: each worker blocks in a read of its request pipe (the pipe write wakes it,
a synchronous wake-up, as the shard processes wait today); ``eventfd``: the request goes to a pipe nobody blocks on
and an eventfd wakes the worker (an asynchronous wake-up). On a quiet 2-core machine both start within ~20 us;
when a third runnable task holds a core the two searches run in series (skew = WORK_MS) either way: the skew
seen in a served Retrieve comes from the number of runnable processes, not from where the kernel places a wakee.

    python bench/wake_probe.py pipe 1500 1.0
    python bench/wake_probe.py eventfd 1500 1.0
"""
import os, sys, time, select, struct
import numpy as np
MODE = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
WORK_MS = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
def burn(ms):
    t = time.thread_time() + ms / 1000
    x = 0
    while time.thread_time() < t:
        x += 1
kids = []
for k in range(2):
    req_r, req_w = os.pipe(); rep_r, rep_w = os.pipe()
    efd = os.eventfd(0) if MODE == "eventfd" else -1
    pid = os.fork()
    if pid == 0:
        os.close(req_w); os.close(rep_r)
        os.set_blocking(req_r, MODE != "eventfd")
        while True:
            if MODE == "eventfd":
                os.eventfd_read(efd)
                try:
                    data = os.read(req_r, 64)
                except BlockingIOError:
                    continue
            else:
                data = os.read(req_r, 64)
            if not data or data[:1] == b"q":
                os._exit(0)
            t = time.perf_counter()
            burn(WORK_MS)
            os.write(rep_w, struct.pack("d", t))
    os.close(req_r); os.close(rep_w)
    kids.append((pid, req_w, rep_r, efd))
time.sleep(0.3)
rt, skew = [], []
for i in range(N):
    t0 = time.perf_counter()
    for pid, w, r, efd in kids:
        os.write(w, b"x")
        if efd >= 0:
            os.eventfd_write(efd, 1)
    starts = []
    for pid, w, r, efd in kids:
        starts.append(struct.unpack("d", os.read(r, 8))[0])
    rt.append(time.perf_counter() - t0); skew.append(abs(starts[1] - starts[0]))
    time.sleep(0.0005)  # the client's turn
for pid, w, r, efd in kids:
    os.write(w, b"q")
    if efd >= 0:
        os.eventfd_write(efd, 1)
rt, skew = np.array(rt) * 1e3, np.array(skew) * 1e3
print(f"{MODE:8s} round p50 {np.median(rt):.3f} ms p90 {np.percentile(rt,90):.3f}  start skew p50 {np.median(skew):.3f} p90 {np.percentile(skew,90):.3f} ms  load {os.getloadavg()[0]:.2f}")
