"""What ``oprag query`` prints when the server answered from some shards only (trial14): the
README promises "never a silently incomplete result", and the gRPC reply says so
(``retrieval.partial``, ``missing_shards``), but the CLI printed the hits with exit status 0 and
its ``--json`` had no field for it. No server: a stand-in client returns the reply."""

from __future__ import annotations

import json

import pytest

from oprag.v1 import oprag_pb2
from oprag_client import cli


class _Stub:
    def __init__(self, reply):
        self.reply = reply

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def retrieve(self, question, **kw):
        return self.reply

    def query(self, question, **kw):
        return self.reply


def _reply(cls, missing):
    r = cls(hits=[oprag_pb2.Hit(chunk_id="a#0", doc_id="a", text="kept", score=1.0)])
    r.retrieval.partial = bool(missing)
    r.retrieval.missing_shards.extend(missing)
    return r


@pytest.mark.parametrize("generate", [False, True])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_partial_result_says_which_shards_are_missing_and_exits_1(monkeypatch, capsys, generate, as_json):
    cls = oprag_pb2.QueryResponse if generate else oprag_pb2.RetrieveResponse
    monkeypatch.setattr(cli, "_client", lambda a: _Stub(_reply(cls, [1])))
    argv = ["query", "--server", "127.0.0.1:1"] + (["--json"] if as_json else []) + ([] if generate else ["--no-generate"])
    assert cli.main(argv + ["lobster"]) == 1
    out, err = capsys.readouterr()
    assert "shard(s) 1 did not answer" in err and "leave out" in err
    if as_json:
        assert json.loads(out)["missing_shards"] == [1]
    else:
        assert "kept" in out or "Sources" in out


def test_a_complete_result_exits_0_and_json_has_no_missing_shards(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_client", lambda a: _Stub(_reply(oprag_pb2.RetrieveResponse, [])))
    assert cli.main(["query", "--server", "127.0.0.1:1", "--json", "--no-generate", "lobster"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["missing_shards"] == [] and err == ""


@pytest.mark.parametrize("reason", ["stop", "length", "no_sources", "no_generator"])
def test_query_json_has_the_finish_reason_of_the_reply(monkeypatch, capsys, reason):
    """``oprag query --json`` says why the answer ended, as the gRPC reply does (trial of issue 17)."""
    r = _reply(oprag_pb2.QueryResponse, [])
    r.finish_reason = reason
    monkeypatch.setattr(cli, "_client", lambda a: _Stub(r))
    assert cli.main(["query", "--server", "127.0.0.1:1", "--json", "lobster"]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] == reason
    monkeypatch.setattr(cli, "_client", lambda a: _Stub(_reply(oprag_pb2.RetrieveResponse, [])))
    assert cli.main(["query", "--server", "127.0.0.1:1", "--json", "--no-generate", "lobster"]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] is None  # nothing was generated


def test_query_json_has_the_retrieval_info_and_the_hit_ranks(monkeypatch, capsys):
    """``retrieval``: every RetrievalInfo field under its proto name (uint64 as a number, not
    MessageToDict's string); null when the reply has none. Hits carry dense_rank / lexical_rank."""
    r = _reply(oprag_pb2.RetrieveResponse, [])
    r.hits[0].dense_rank, r.hits[0].lexical_rank = 3, 0
    r.retrieval.MergeFrom(oprag_pb2.RetrievalInfo(mode="hybrid", fusion="rrf", rrf_k=60, candidates=256,
                                                  chunks_searched=2**40))
    monkeypatch.setattr(cli, "_client", lambda a: _Stub(r))
    assert cli.main(["query", "--server", "127.0.0.1:1", "--json", "--no-generate", "lobster"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["retrieval"]) == [f.name for f in oprag_pb2.RetrievalInfo.DESCRIPTOR.fields]
    assert out["retrieval"] == {
        "mode": "hybrid", "fusion": "rrf", "dense_weight": 0.0, "lexical_weight": 0.0, "rrf_k": 60, "candidates": 256,
        "chunks_searched": 2**40, "partial": False, "missing_shards": [], "dense_index": "", "ef_search": 0,
        "nprobe": 0, "lexical_candidates": 0, "certified": False, "widen_rounds": 0, "exact": False}
    assert (out["hits"][0]["dense_rank"], out["hits"][0]["lexical_rank"]) == (3, 0)
    monkeypatch.setattr(cli, "_client", lambda a: _Stub(oprag_pb2.RetrieveResponse()))
    assert cli.main(["query", "--server", "127.0.0.1:1", "--json", "--no-generate", "lobster"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["retrieval"] is None and out["missing_shards"] == [] and out["hits"] == []
