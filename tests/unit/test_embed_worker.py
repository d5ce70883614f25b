"""The embed worker: queries before ingest, chunks pooled across streams, order restored."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from oprag_server.engine.embedder import EmbedWorker
from oprag_server.service.metrics import Metrics


class RecordingEncoder:
    dim = 3

    def __init__(self, delay=0.02, query_delay=None):
        self.calls = []
        self.delay = delay
        self.query_delay = delay if query_delay is None else query_delay
        self.lock = threading.Lock()

    def encode(self, texts, truncate=False):
        self.calls.append(("query", len(texts)))
        time.sleep(self.query_delay)
        return np.array([[len(t), 0, 1] for t in texts], np.float32)

    def encode_tokenized(self, ids):
        self.calls.append(("ingest", len(ids)))
        time.sleep(self.delay)
        self.last_padded_tokens = max(len(x) for x in ids) * len(ids)
        return np.array([[x[0], len(x), 0] for x in ids], np.float32)


def test_streams_are_pooled_and_results_come_back_in_order():
    async def run():
        enc = RecordingEncoder()
        w = EmbedWorker(enc, ThreadPoolExecutor(1), Metrics(), batch_size=4)
        w.start()
        a = [[i] * (1 + i % 3) for i in range(10)]
        b = [[100 + i] for i in range(7)]
        ra, rb = await asyncio.gather(w.embed_chunks(a), w.embed_chunks(b))
        await w.stop()
        return enc, a, b, ra, rb

    enc, a, b, ra, rb = asyncio.run(run())
    assert ra[:, 0].tolist() == [x[0] for x in a] and ra[:, 1].tolist() == [len(x) for x in a]
    assert rb[:, 0].tolist() == [x[0] for x in b]
    assert enc.calls[0] == ("ingest", 16)  # one forward pass took chunks of both streams


def test_queries_jump_ahead_of_ingest_and_shrink_its_batches():
    async def run():
        enc = RecordingEncoder(delay=0.03)
        w = EmbedWorker(enc, ThreadPoolExecutor(1), Metrics(), batch_size=8, small_batch=2)
        w.start()
        ingest = asyncio.create_task(w.embed_chunks([[i] for i in range(200)]))
        await asyncio.sleep(0.01)
        t = time.perf_counter()
        q = await w.embed_queries(["hello"])
        waited = time.perf_counter() - t
        await ingest
        await w.stop()
        return enc, q, waited

    enc, q, waited = asyncio.run(run())
    assert q[0, 0] == 5
    first_query = enc.calls.index(("query", 1))
    assert first_query <= 1  # at most one ingest batch ran before the query
    assert waited < 0.2
    assert ("ingest", 2) in enc.calls[first_query:]  # ingest batches shrink while queries are active


def test_query_thread_runs_beside_an_ingest_batch_which_keeps_its_size():
    async def run():
        enc = RecordingEncoder(delay=0.3, query_delay=0.01)  # long ingest forward passes
        w = EmbedWorker(enc, ThreadPoolExecutor(1), Metrics(), batch_size=8, small_batch=2,
                        query_executor=ThreadPoolExecutor(1))
        w.start()
        ingest = asyncio.create_task(w.embed_chunks([[i] for i in range(64)]))
        await asyncio.sleep(0.05)  # the first ingest pass (32 chunks, 0.3 s) is running
        t = time.perf_counter()
        q = await w.embed_queries(["hello"])
        waited = time.perf_counter() - t
        r = await ingest
        await w.stop()
        return enc, q, waited, r

    enc, q, waited, r = asyncio.run(run())
    assert q[0, 0] == 5 and r[:, 0].tolist() == list(range(64))
    assert waited < 0.2  # did not wait for the 0.3 s ingest pass in flight
    assert [c for c in enc.calls if c[0] == "ingest"] == [("ingest", 32), ("ingest", 32)]  # batches not shrunk
