"""What ``oprag ingest`` says it stored when it stops part-way (README: "When a stream fails,
the command says which streams were committed before it"). No server: a stand-in client
commits every stream it is given."""

from __future__ import annotations

import json

import grpc
import pytest

from oprag.v1 import oprag_pb2
from oprag_client import cli, cli_ingest


class _Stub:
    max_message_bytes = 32 << 20  # (OpRAGClient's default)

    def __init__(self, fail_at: int | None = None):
        self.streams, self.fail_at = [], fail_at

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def ingest(self, docs):
        if len(self.streams) + 1 == self.fail_at:
            raise _Unavailable()
        self.streams.append([d.id for d in docs])
        return oprag_pb2.IngestResponse(documents_written=len(docs), chunks_written=len(docs), seq=len(self.streams))


class _Unavailable(grpc.RpcError):
    final_message_sent = False  # (OpRAGClient.ingest's mark: the stream's final message was not sent)

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "shard 1 is down"


def _file(tmp_path, good: int, bad_line: bool):
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"id": f"d{i}", "text": f"doc {i}"}) for i in range(good)]
    f.write_text("\n".join(lines + (["{broken", json.dumps({"id": "after", "text": "x"})] if bad_line else [])) + "\n")
    return f


def test_a_bad_line_after_full_streams_says_every_one_of_them_was_committed(tmp_path, monkeypatch, capsys):
    """trial14: 10 good lines, then a broken one, 3 documents per stream: streams 1-3 (9 documents)
    committed and the broken line stopped the 4th while it was read; the command said "streams 1-2
    were committed ...; stream 3 ... and the rest stored nothing"."""
    stub = _Stub()
    monkeypatch.setattr(cli_ingest, "_client", lambda a: stub)
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--docs-per-stream", "3", "--no-progress"]
    assert cli.main(argv + [str(_file(tmp_path, 10, True))]) == 1
    err = capsys.readouterr().err
    assert len(stub.streams) == 3
    assert ("streams 1-3 were committed (the first 9 documents of the input, seq 3); stream 4 (its document 0 is "
            "input document #9) and the rest stored nothing") in err, err
    assert "d.jsonl:11:" in err


@pytest.mark.parametrize("fail_at, words", [
    (1, "no stream was committed; stream 1 (its document 0 is input document #0) and the rest stored nothing"),
    (2, "stream 1 was committed (the first 3 documents of the input, seq 1); stream 2 (its document 0 is input document #3)"),
    (3, "streams 1-2 were committed (the first 6 documents of the input, seq 2); stream 3 (its document 0 is input document #6)"),
])
def test_a_stream_the_server_fails_is_named_and_the_ones_before_it_committed(tmp_path, monkeypatch, capsys, fail_at, words):
    monkeypatch.setattr(cli_ingest, "_client", lambda a: _Stub(fail_at))
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--docs-per-stream", "3", "--no-progress"]
    assert cli.main(argv + [str(_file(tmp_path, 10, False))]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE: shard 1 is down" in err
    assert words in err, err


class _CutAfterFinal(_Unavailable):
    final_message_sent = True

    def details(self):
        return "Socket closed"


class _RefusedAfterFinal(_Unavailable):
    """trial48 #18: a shard down refused the stream after its final message, before the commit began; the
    server's status says so in its trailer (``oprag-stored: none``)."""
    final_message_sent = True

    def trailing_metadata(self):
        return (("oprag-stored", "none"),)


@pytest.mark.parametrize("error, stored, words", [
    (_Unavailable, False, "stream 1 (its document 0 is input document #0) and the rest stored nothing"),
    (_RefusedAfterFinal, False, "stream 1 (its document 0 is input document #0) and the rest stored nothing"),
    (_CutAfterFinal, None, "stream 1 (its document 0 is input document #0) ended UNAVAILABLE after its final message "
                           "was sent (the connection was lost, or the server failed while it committed): it is stored "
                           "whole or not at all"),
])
def test_a_stream_cut_short_after_its_final_message_may_be_stored(tmp_path, monkeypatch, capsys, error, stored, words):
    """trial35: a server killed (kill -9) while it committed a stream: the CLI said the stream
    "stored nothing" (and ``stored: false``), but the stream had been committed. Once gRPC had
    the final message, a lost connection leaves the outcome unknown; before it, nothing."""
    class _Stub1(_Stub):
        def ingest(self, docs):
            raise error()

    monkeypatch.setattr(cli_ingest, "_client", lambda a: _Stub1())
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress", "--json"]
    assert cli.main(argv + [str(_file(tmp_path, 2, False))]) == 1
    out = capsys.readouterr()
    assert words in out.err, out.err
    assert json.loads(out.out)["error"]["stored"] is stored


class _Rejecting(_Stub):
    """Rejects the documents whose id starts with ``bad``."""

    def ingest(self, docs):
        self.streams.append([d.id for d in docs])
        rej = [oprag_pb2.RejectedDocument(index=i, id=d.id, reason="text is empty") for i, d in enumerate(docs)
               if d.id.startswith("bad")]
        ok = len(docs) - len(rej)
        return oprag_pb2.IngestResponse(documents_written=ok, chunks_written=ok, seq=len(self.streams), rejected=rej)


@pytest.mark.parametrize("ids,code", [(["bad1", "bad2", "bad3"], 1), (["bad1", "ok1", "bad2"], 0)])
def test_every_document_rejected_exits_1(ids, code, tmp_path, monkeypatch, capsys):
    """trial14: an ingest that stored nothing because every document was rejected exited 0; some
    rejected documents alone still exit 0 (each is listed on stderr either way)."""
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "text": f"doc {i}"}) for i in ids) + "\n")
    monkeypatch.setattr(cli_ingest, "_client", lambda a: _Rejecting())
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress", str(f)]) == code
    err = capsys.readouterr().err
    assert err.count("rejected #") == sum(i.startswith("bad") for i in ids)
    assert ("nothing stored: all 3 documents were rejected" in err) == (code == 1)


NONE_COMMITTED = "oprag: no stream was committed; stream 1 (its document 0 is input document #0) and the rest stored nothing\n"


@pytest.mark.parametrize("lines, line, words", [
    (["{broken"], 1, "expected a JSON object"),
    # trial26: a valid line 1, then an integer metadata value outside signed 64-bit
    ([json.dumps({"id": "m1", "text": "one", "metadata": {"n": 3}}),
      json.dumps({"id": "m2", "text": "two", "metadata": {"n": 2**63}})], 2, "metadata 'n': integer"),
])
def test_an_input_error_before_any_stream_was_sent_says_no_stream_was_committed(tmp_path, monkeypatch, capsys,
                                                                                 lines, line, words):
    """trial26 #3: an input error in stream 1 printed only the error, not whether anything was
    stored (README: the command says which streams were committed); now as for a later stream:
    "no stream was committed ...", then the error."""
    stub = _Stub()
    monkeypatch.setattr(cli_ingest, "_client", lambda a: stub)
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress"]
    assert cli.main(argv + [str(f)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(NONE_COMMITTED + f"oprag: {f}:{line}: {words}"), err
    assert cli.main(argv + ["--json", str(f)]) == 1
    out = capsys.readouterr()
    assert out.err.startswith(NONE_COMMITTED), out.err
    assert json.loads(out.out)["error"] == {"stream": 1, "first_index": 0, "code": None, "stored": False,
                                            "message": out.err[len(NONE_COMMITTED) + len("oprag: "):].strip()}
    assert stub.streams == []


@pytest.mark.parametrize("name, fmt", [("d.jsonl", "jsonl"), ("D.NDJSON", "jsonl"), ("t.parquet", "parquet"),
                                       ("t.arrow", "arrow")])
def test_a_jsonl_parquet_or_arrow_file_without_format_is_refused_not_stored_as_text(tmp_path, monkeypatch, capsys,
                                                                                     name, fmt):
    """trial35: ``oprag ingest ok.jsonl`` (no --format: text) stored the raw JSON as one text
    document, exit 0. Now it is refused before anything is sent; --format text still stores it."""
    stub = _Stub()
    monkeypatch.setattr(cli_ingest, "_client", lambda a: stub)
    f = tmp_path / name
    f.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--no-progress", str(f)]) == 2
    assert (f"{f} looks like --format {fmt} input, and without --format it would be stored as one text document: "
            f"give --format {fmt}") in capsys.readouterr().err
    assert stub.streams == []
    if fmt == "jsonl" and name.endswith(".jsonl"):
        assert cli.main(["ingest", "--server", "127.0.0.1:1", "--no-progress", "--format", "text", str(f)]) == 0
        assert stub.streams == [[name]]


def test_a_document_too_large_for_a_message_is_rejected_alone(tmp_path, monkeypatch, capsys):
    """trial35: a 40 MB document (over the 32 MiB gRPC message limit) failed its whole stream
    client-side, so the small documents beside it were not stored; a 9 MB one (over the
    server's 8 MiB document limit) was the server's rejection of that document alone. Now both
    are per-document rejections, with the input position of each."""
    stub = _Stub()
    stub.max_message_bytes = 1 << 16  # (a 64 KiB limit stands for 32 MiB)
    monkeypatch.setattr(cli_ingest, "_client", lambda a: stub)
    f = tmp_path / "d.jsonl"
    rows = [{"id": "a", "text": "small"}, {"id": "big", "text": "x" * 70_000}, {"id": "b", "text": "small"},
            {"id": "c", "text": "small"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress", "--json", "--docs-per-stream", "2"]
    assert cli.main(argv + [str(f)]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)
    assert stub.streams == [["a", "b"], ["c"]]
    assert [(r["index"], r["id"]) for r in res["rejected"]] == [(1, "big")]
    assert "over the 64512 bytes one ingest message can carry (the 65536-byte gRPC message limit" in \
        res["rejected"][0]["reason"] and "not sent" in res["rejected"][0]["reason"]
    assert [(s["first_index"], s["documents_sent"]) for s in res["streams"]] == [(0, 2), (3, 1)]
    assert "rejected #1 'big'" in out.err


def test_a_refused_ingest_prints_every_key_of_a_summary(tmp_path, monkeypatch, capsys):
    """trial38b: ``oprag ingest --json`` on a missing path printed documents, chunks, rejected,
    streams and error only; a script reading ``chunks_per_s`` or ``seq`` failed on it. A refusal now
    has every key a committed ingest's object has, plus ``error``."""
    monkeypatch.setattr(cli_ingest, "_client", lambda a: _Rejecting())
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress", "--json"]
    assert cli.main(argv + [str(_file(tmp_path, 2, False))]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert cli.main(argv + [str(tmp_path / "missing.jsonl")]) == 2  # (an argument refused: USAGE, trial51)
    refused = json.loads(capsys.readouterr().out)
    assert set(refused) == set(ok) | {"error"}
    assert (refused["documents"], refused["chunks"], refused["seq"], refused["streams"]) == (0, 0, 0, [])
    assert refused["error"]["stored"] is False and "missing.jsonl" in refused["error"]["message"]


class _CtrlC(_Stub):
    """Ctrl-C while stream ``fail_at`` is in flight."""

    def ingest(self, docs):
        if len(self.streams) + 1 == self.fail_at:
            raise KeyboardInterrupt
        return super().ingest(docs)


def test_ctrl_c_during_a_stream_says_what_was_committed(tmp_path, monkeypatch, capsys):
    """README: Ctrl-C cancels the stream in flight and reports as a failed stream (CANCELLED, interrupted (Ctrl-C)),
    exit status 130; the stream in flight is stored whole or not at all."""
    monkeypatch.setattr(cli_ingest, "_client", lambda a: _CtrlC(2))
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--docs-per-stream", "3", "--no-progress",
            "--json"]
    assert cli.main(argv + [str(_file(tmp_path, 10, False))]) == 130
    out = capsys.readouterr()
    assert json.loads(out.out)["error"] == {"stream": 2, "first_index": 3, "code": "CANCELLED",
                                            "message": "interrupted (Ctrl-C)", "stored": None}
    assert "stream 1 was committed" in out.err and out.err.endswith("oprag: interrupted (Ctrl-C)\n"), out.err


def test_ctrl_c_before_the_first_stream_prints_the_summary_keys(tmp_path, monkeypatch, capsys):
    """trial51 #1: a Ctrl-C outside the streams' loop (here while the paths are checked) was a traceback; now
    main's handler reports it, with ingest's keys."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_ingest, "_not_a_file", interrupted)
    argv = ["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", "--no-progress", "--json"]
    try:
        got = cli.main(argv + [str(_file(tmp_path, 2, False))])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped (a traceback)")
    out = capsys.readouterr()
    assert got == 130 and out.err == "oprag: interrupted (Ctrl-C)\n"
    obj = json.loads(out.out)
    assert obj["error"]["code"] == "CANCELLED" and obj["streams"] == [] and "chunks_per_s" in obj
