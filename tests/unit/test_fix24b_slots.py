"""trial24 finding 3: ingest slots and the idle limit, in process (no server; the served test is
tests/integration/test_fix24b.py). Before, four streams that stopped sending held every slot of
an ``asyncio.Semaphore`` without a timeout, and every further stream waited forever."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from oprag_client import cli, cli_ingest
from oprag_client.client import Doc, ingest_messages
from oprag_server.cli import build_parser, config_from_args
from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig
from oprag_server.engine.ingest import IngestPipeline
from oprag_server.engine.ingest_slots import IngestBusy, IngestIdle, StreamSlots, idle_limited
from oprag_server.models.fakes import HashingEncoder
from oprag_server.service.interceptors import status_for
from oprag_server.service.metrics import Metrics

from test_commit import DIM, _protocol


def _count(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels or None) or 0.0


def test_a_stream_waits_for_a_slot_a_bounded_time_and_is_refused_resource_exhausted(caplog):
    m = Metrics()
    slots = StreamSlots(IngestConfig(max_concurrent_streams=1, slot_wait_s=0.3), m)

    async def main():
        async with slots.held():
            t = time.perf_counter()
            with pytest.raises(IngestBusy) as ei:
                async with slots.held():
                    pass
            waited = time.perf_counter() - t
            with pytest.raises(IngestBusy) as short:  # the caller's deadline 0.6 s away: refused after ~0.1 s
                async with slots.held(time_left=0.6):
                    pass
        async with slots.held(time_left=0.6):  # free again: taken at once
            pass
        return ei.value, waited, short.value

    exc, waited, short = asyncio.run(main())
    assert 0.25 <= waited < 2.0
    assert "1 ingest streams are in progress (--max-ingest-streams 1)" in str(exc)
    assert "--ingest-slot-wait-s 0.3" in str(exc) and "nothing of it was stored; retry later" in str(exc)
    assert "deadline" in str(short)
    code, msg, trailers = status_for(exc, "Ingest")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and msg == str(exc) and trailers[0][0] == "retry-after-ms"
    assert _count(m, "oprag_overload_rejections_total", queue="ingest") == 2
    assert sum("Ingest stream refused" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records) == 2


def test_idle_limited_cuts_a_quiet_stream_and_not_a_slow_steady_one(caplog):
    async def quiet():
        yield 1
        await asyncio.sleep(30)
        yield 2

    async def steady():
        for i in range(6):
            await asyncio.sleep(0.1)
            yield i

    async def main():
        got = []
        with pytest.raises(IngestIdle) as ei:
            async for x in idle_limited(quiet(), 0.3):
                got.append(x)
        return got, ei.value, [x async for x in idle_limited(steady(), 0.3)], [x async for x in idle_limited(steady(), 0)]

    got, exc, steady_got, unlimited = asyncio.run(main())
    assert got == [1] and steady_got == unlimited == list(range(6))
    assert "--ingest-idle-s 0.3" in str(exc) and "nothing of it was stored" in str(exc)
    assert status_for(exc, "Ingest")[0] == grpc.StatusCode.ABORTED
    assert sum("Ingest stream aborted" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records) == 1


def test_an_idle_stream_is_aborted_stores_nothing_and_frees_its_slot():
    cp = _protocol()
    m = Metrics()
    p = IngestPipeline(encoder=HashingEncoder(dim=DIM), pool=cp.pool, commit=cp.commit, chunking=ChunkingConfig(),
                       cfg=IngestConfig(max_concurrent_streams=1, slot_wait_s=5, idle_s=0.3), limits=LimitsConfig(),
                       embedder=None, metrics=m, next_generation=lambda: 1)
    docs = [Doc(d, f"text of {d}", vector=[1.0 + i] + [0.5] * (DIM - 1)) for i, d in enumerate("abc")]

    async def stalled():
        msgs = list(ingest_messages(docs))
        yield msgs[0].__class__(documents=msgs[0].documents)  # the documents, not the final message
        await asyncio.sleep(60)

    async def whole():
        for msg in ingest_messages(docs):
            yield msg

    async def main():
        quiet = asyncio.create_task(p.run(stalled()))
        await asyncio.sleep(0.05)
        ok = await p.run(whole())  # waits for the slot the quiet stream frees when it is aborted
        with pytest.raises(IngestIdle):
            await quiet
        return ok

    ok = asyncio.run(main())
    assert ok.documents_written == 3 and ok.seq == 1  # the idle stream took no sequence number
    assert _count(m, "oprag_ingest_streams_aborted_total") == 1
    assert _count(m, "oprag_documents_ingested_total") == 3


def test_the_options_and_their_checks():
    cfg = config_from_args(build_parser().parse_args(
        ["--max-ingest-streams", "2", "--ingest-slot-wait-s", "2.5", "--ingest-idle-s", "0"]))
    assert (cfg.ingest.max_concurrent_streams, cfg.ingest.slot_wait_s, cfg.ingest.idle_s) == (2, 2.5, 0.0)
    assert (IngestConfig().slot_wait_s, IngestConfig().idle_s) == (30.0, 300.0)
    for kw, words in (({"max_concurrent_streams": 0}, "max ingest streams must be >= 1"),
                      ({"slot_wait_s": -1}, "ingest slot wait (s) must be >= 0"),
                      ({"idle_s": -0.5}, "ingest idle limit (s) must be >= 0")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            IngestConfig(**kw)


class _Busy(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "4 ingest streams are in progress (--max-ingest-streams 4); ... retry later"


class _Client:
    max_message_bytes = 32 << 20  # (OpRAGClient's default)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def ingest(self, docs):
        raise _Busy()


def test_the_cli_says_a_refused_stream_was_not_started_and_to_retry(tmp_path, monkeypatch, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text('{"id": "a", "text": "one"}\n')
    monkeypatch.setattr(cli_ingest, "_client", lambda a: _Client())
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress", "--timeout", "20",
                     "--json", str(f)]) == 1
    out, err = capsys.readouterr()
    assert "was refused before the server started it: it and the rest stored nothing; retry later" in err, err
    assert "stored whole or not at all" not in err and "larger --timeout" not in err
    assert '"stored": false' in out and '"code": "RESOURCE_EXHAUSTED"' in out
