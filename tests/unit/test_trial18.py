"""Findings of trial18 (a new user probing start-up options, a full data directory and the CLI)."""

from __future__ import annotations

import pytest

from oprag_server import cli
from oprag_server.config import IngestConfig, ServerConfig


@pytest.mark.parametrize("n", [0, -1])
def test_upsert_batch_below_one_is_refused_at_start(n, capsys):
    """--upsert-batch 0 used to start, and then every ingest failed with INTERNAL ("ValueError:
    need at least one array to stack": the upsert stage sent empty batches); now a start-up error,
    exit status 2, naming the option's value."""
    with pytest.raises(ValueError, match=r"upsert batch must be >= 1, got "):
        ServerConfig(ingest=IngestConfig(upsert_batch=n))
    assert cli.main(["--upsert-batch", str(n)]) == 2
    assert f"--upsert-batch must be >= 1, got {n}" in capsys.readouterr().err


def test_upsert_batch_of_one_is_usable():
    assert ServerConfig(ingest=IngestConfig(upsert_batch=1)).ingest.upsert_batch == 1


def test_retry_after_trailer_is_jittered_so_refused_clients_do_not_return_together():
    """RetryPolicy waited exactly the server's retry-after-ms: clients refused by a full queue
    at the same moment all came back at the same moment and were refused again (6 threads on
    --queue-capacity 1: 5 of 6 gave up after 6 attempts). The wait is now the trailer's value
    plus a random share of up to as much again (README: Python client retries)."""
    import grpc

    from oprag_client.retry import RetryPolicy

    class Full(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def trailing_metadata(self):
            return (("retry-after-ms", "500"),)

    waits = [RetryPolicy(max_attempts=6).delay(Full(), 0) for _ in range(200)]
    assert all(0.5 <= w <= 1.0 for w in waits), (min(waits), max(waits))
    assert max(waits) - min(waits) > 0.2, (min(waits), max(waits))
    assert RetryPolicy(max_attempts=6, max_backoff_s=0.6).delay(Full(), 0) <= 0.6  # still capped


@pytest.mark.parametrize("generator", ["none", "builtin", "smollm2"])
def test_memory_condense_without_an_engine_generator_is_refused_at_start(generator, capsys):
    """--memory-condense with --generator none was accepted and did nothing (no rewriter), with
    the builtin generator the start failed only after the shard processes had started (the
    memory operator refused it); README: engine generators only. Now a start-up error, exit
    status 2, naming both options. With an engine generator it is accepted."""
    from oprag_server.config import GenerateConfig, MemoryConfig

    with pytest.raises(ValueError, match=r"--memory-condense needs an engine generator"):
        ServerConfig(generate=GenerateConfig(model=generator), memory=MemoryConfig(condense=True))
    assert cli.main(["--generator", generator, "--memory-condense"]) == 2
    err = capsys.readouterr().err
    assert "--memory-condense needs an engine generator (--generator openai or transformers-serve)" in err, err
    assert f"got --generator {generator}" in err, err
    assert ServerConfig(generate=GenerateConfig(model="transformers-serve"), memory=MemoryConfig(condense=True))
    assert ServerConfig(generate=GenerateConfig(model=generator)).memory.condense is False  # (the default)


def test_a_chunk_size_without_room_for_text_is_refused_before_the_data_directory_is_written(tmp_path, capsys):
    """--chunk-size 1 (or 2: MiniLM adds [CLS] and [SEP] to every chunk) was refused only when the
    ingest pipeline built its chunker, after the shard processes had started; the failed start
    then left oprag.json and the shards' snapshots in the data directory. Now the start-up check
    (startup.preflight, with the embedder's tokenizer) refuses it first: exit status 2, the
    message names the option and the smallest size that works, nothing is written."""
    from oprag_client.testing import free_port

    data = tmp_path / "data"
    for size in (1, 2):
        assert cli.main(["--chunk-size", str(size), "--generator", "none", "--shards", "1", "--data-dir", str(data),
                         "--port", "0", "--metrics-port", str(free_port())]) == 2
        err = capsys.readouterr().err
        assert (f"--chunk-size {size} leaves no room for text next to the 2 special tokens the embedder adds to each "
                "chunk: use --chunk-size 3 or more") in err, err
        assert not data.exists()


@pytest.mark.parametrize("as_json", [False, True])
def test_oprag_stats_prints_every_shard_field_of_the_reply(monkeypatch, capsys, as_json):
    """``oprag stats`` printed documents, chunks, memory records and applied_seq per shard; the
    Stats reply's ann_pending, merge_pending, segment_unsaved_bytes and the memory estimates
    (postings_bytes ... chunks_bytes) were left out. Every field of ShardStats is printed now,
    under its proto name, as plain and as --json output. No server: a stand-in client answers."""
    import json

    from oprag.v1 import oprag_pb2
    from oprag_client import cli as client_cli

    fields = [f.name for f in oprag_pb2.ShardStats.DESCRIPTOR.fields]
    assert {"ann_pending", "merge_pending", "segment_unsaved_bytes", "postings_bytes", "chunks_bytes"} <= set(fields)
    reply = oprag_pb2.StatsResponse(documents=3, chunks=9, seq=4, embedder="minilm", generator="none", shards=[
        oprag_pb2.ShardStats(**{name: 100 * s + i + 1 for i, name in enumerate(fields) if name != "shard"}, shard=s)
        for s in range(2)])

    class Stub:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stats(self):
            return reply

    monkeypatch.setattr(client_cli, "_client", lambda a: Stub())
    assert client_cli.main(["stats", "--server", "127.0.0.1:1"] + (["--json"] if as_json else [])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shards"] == [{name: getattr(s, name) for name in fields} for s in reply.shards]
    assert (out["documents"], out["chunks"], out["seq"], out["missing_shards"]) == (3, 9, 4, [])


def test_a_full_query_queue_hints_the_service_time_of_the_requests_that_leave_it_first():
    """A full query queue refused with ``retry_after_s = max(0.05, generation batch EWMA)``: 0.5 s
    at start, never updated without the builtin generator (--generator none), also when every
    admitted request only retrieves (~20 ms): refused Retrieve clients waited 25x too long. The
    hint is now the recent service time of the kind of request that frees a slot first:
    retrieval-only while one is admitted, else generating; within [0.05, 30] s. The query
    engine with the fakes of test_scheduler (no models, no shards)."""
    import asyncio

    from oprag_server.engine.query import Overloaded
    from test_scheduler import FakeGenerator, FakeRetriever, _engine, _job  # (tests/unit is on sys.path)

    class SlowRetriever(FakeRetriever):
        async def retrieve(self, vecs, texts, specs):
            await asyncio.sleep(0.1)
            return await super().retrieve(vecs, texts, specs)

    async def refused(eng, job) -> float:
        with pytest.raises(Overloaded) as e:
            await eng.submit(job)
        return e.value.retry_after_s

    async def run():
        eng = _engine(FakeGenerator(0.3), SlowRetriever(), capacity=2, max_batch=1)
        eng.start()
        for i in range(8):  # the retrieval EWMA learns ~0.1 s
            await eng.submit(_job(f"r{i}", generate=False))
        full = [asyncio.create_task(eng.submit(_job(f"f{i}", generate=False))) for i in range(2)]
        await asyncio.sleep(0.02)
        hints = [await refused(eng, _job("late", generate=False)), await refused(eng, _job("late gen"))]
        await asyncio.gather(*full)
        full = [asyncio.create_task(eng.submit(_job(f"g{i}"))) for i in range(2)]  # generating ones only
        await asyncio.sleep(0.02)
        hints.append(await refused(eng, _job("late", generate=False)))
        await asyncio.gather(*full)
        await eng.stop()
        eng.generate_s = 1000.0  # (nothing admitted now: a generation's time is the hint, capped)
        hints.append(eng.retry_after_s())
        return hints

    retrieving, retrieving_gen, generating, capped = asyncio.run(run())
    assert 0.08 <= retrieving <= 0.2 and retrieving_gen == retrieving, (retrieving, retrieving_gen)
    assert generating >= 0.3, generating  # a generation batch: 0.5 at start, 0.3 s per batch since
    assert capped == 30.0
