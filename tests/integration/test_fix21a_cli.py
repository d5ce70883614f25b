"""Findings of trial21 at the ``oprag`` command line, against a real server (2 shards, no
generator): ``ingest --json`` printed nothing when a stream failed; ``--timeout`` failures said
nothing about what was stored; ``stats --json | head -c 10`` exited 0 (or 120, with "Exception
ignored ... BrokenPipeError") while a shard was down; ``eval beir`` said nothing when the service
lacked most of the judged documents; a folder where a file is expected was a raw ``[Errno 21]``
(or a traceback); an unresolvable ``--server`` named its address twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from oprag_client import cli
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, oprag_cli, wait_until
from test_trial15 import _shard_pid  # (tests/integration is on sys.path: pytest's rootdir-relative import)

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("fix21a-data"), "--generator", "none", "--shards", "2")
    srv.start()
    yield srv
    srv.stop()


def _oprag(server, *args, timeout=120):
    return subprocess.run([*oprag_cli(), *args, "--server", server.target], capture_output=True, text=True,
                          timeout=timeout)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _vec(seed, d=384):
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32).tolist()


def test_ingest_json_prints_what_was_committed_when_a_stream_fails(server, tmp_path):
    """Stream 2 holds a vector of the wrong width: the server refuses that stream (nothing of it
    stored) after stream 1 committed. Before: stderr only, no JSON at all."""
    rows = [{"id": f"j{i}", "text": f"json summary document {i}", "vector": _vec(i, 3 if i == 3 else 384)}
            for i in range(6)]
    out = _oprag(server, "ingest", "--format", "jsonl", "--json", "--no-progress", "--docs-per-stream", "2",
                 _jsonl(tmp_path / "w.jsonl", rows))
    assert out.returncode == 1, out.stderr
    res = json.loads(out.stdout)
    assert (res["documents"], res["chunks"]) == (2, 2)
    assert [(s["stream"], s["first_index"], s["documents_sent"], s["documents_written"]) for s in res["streams"]] \
        == [(1, 0, 2, 2)]
    assert res["seq"] == res["streams"][0]["seq"] > 0
    err = res["error"]
    assert (err["stream"], err["first_index"], err["code"], err["stored"]) == (2, 2, "INVALID_ARGUMENT", False)
    assert err["message"].startswith("INVALID_ARGUMENT: document 1 ('j3'): a vector has 3 values"), err
    assert err["message"].endswith("(document 1 of stream 2 is input document #3)"), err
    assert "stream 1 was committed (the first 2 documents of the input" in out.stderr, out.stderr
    with OpRAGClient(server.target, timeout=60) as c:
        hits = c.retrieve("json summary document", mode="lexical", top_k=10).hits
    assert sorted({h.doc_id for h in hits}) == ["j0", "j1"]


def test_ingest_json_names_an_input_error_after_committed_streams(server, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text("".join(json.dumps({"id": f"k{i}", "text": f"input error document {i}", "vector": _vec(i)}) + "\n"
                         for i in range(3)) + "{broken\n")
    out = _oprag(server, "ingest", "--format", "jsonl", "--json", "--no-progress", "--docs-per-stream", "2", str(f))
    assert out.returncode == 1, out.stderr
    res = json.loads(out.stdout)
    assert res["documents"] == 2 and len(res["streams"]) == 1
    assert (res["error"]["stream"], res["error"]["code"], res["error"]["stored"]) == (2, None, False)
    assert res["error"]["message"].startswith(f"{f}:4: expected a JSON object"), res["error"]


def test_ingest_timeout_says_what_was_stored(server, tmp_path):
    """``--timeout 0.01``: said only "DEADLINE_EXCEEDED: Deadline Exceeded"; a stream whose
    deadline passed may have been committed (README: ingest semantics), so it says so."""
    rows = [{"id": f"t{i}", "text": f"timeout document {i}"} for i in range(4)]
    out = _oprag(server, "ingest", "--format", "jsonl", "--json", "--no-progress", "--timeout", "0.01",
                 _jsonl(tmp_path / "t.jsonl", rows))
    assert out.returncode == 1, out.stderr
    assert ("oprag: no stream was committed; stream 1 (its document 0 is input document #0) ended DEADLINE_EXCEEDED "
            "before the server answered: it is stored whole or not at all") in out.stderr, out.stderr
    assert "--timeout 0.01 s is each stream's deadline" in out.stderr
    res = json.loads(out.stdout)
    assert res["streams"] == [] and res["error"]["code"] == "DEADLINE_EXCEEDED" and res["error"]["stored"] is None


def test_eval_beir_warns_when_the_service_lacks_most_judged_documents(server, tmp_path):
    n = 10
    corpus = [Doc(f"e{i}", f"evalword{i} appears in this judged document", vector=np.asarray(_vec(100 + i),
                                                                                             np.float32))
              for i in range(n)]
    queries = _jsonl(tmp_path / "queries.jsonl", [{"_id": f"q{i}", "text": f"evalword{i}"} for i in range(n)])
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\te{i}\t1\n" for i in range(n)))
    args = ("eval", "beir", "--queries", queries, "--qrels", str(tmp_path / "qrels.tsv"), "--mode", "lexical")
    with OpRAGClient(server.target, timeout=60) as c:
        c.ingest(corpus[:3])
        out = _oprag(server, *args)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        assert (res["judged_docs"], res["judged_docs_retrieved"], res["recall@100"]) == (n, 3, 0.3)
        assert res["warning"].startswith("only 3 of the 10 relevant documents of the qrels (30%) were retrieved"), res
        assert "oprag: warning: only 3 of the 10 relevant documents" in out.stderr
        c.ingest(corpus[3:])
        out = _oprag(server, *args)
    res = json.loads(out.stdout)
    assert (res["judged_docs"], res["judged_docs_retrieved"]) == (n, n) and "warning" not in res, res
    assert "warning" not in out.stderr


@pytest.mark.parametrize("argv, message", [
    (["ingest", "--format", "jsonl", "{d}"], "{d} is a folder: --format jsonl reads JSON-lines files; give the file(s) in "
                                             "it, e.g. {d}/*.jsonl"),
    (["ingest", "--format", "wikitext", "{d}"], "{d} is a folder: --format wikitext reads WikiText files"),
    (["ingest", "--format", "beir", "{d}"], "{d} is a folder without corpus.jsonl: --format beir reads a BEIR "
                                            "corpus.jsonl, or a folder holding one"),
    (["eval", "beir", "--queries", "{d}", "--qrels", "{d}/q.tsv"], "--queries {d} is a folder: give the BEIR "
                                                                   "queries file (queries.jsonl)"),
    (["eval", "beir", "--queries", "{d}/q.jsonl", "--qrels", "{d}"], "--qrels {d} is a folder: give a BEIR qrels file"),
    (["stats", "--tls-ca", "{d}"], "--tls-ca {d} is a folder: give the CA certificate file (PEM)"),
])
def test_a_folder_where_a_file_is_expected_names_the_option(tmp_path, capsys, argv, message):
    """Said "[Errno 21] Is a directory: '...'" (with "cannot read queries/qrels: " for eval);
    ``--tls-ca FOLDER`` was a traceback."""
    d = str(tmp_path)
    (tmp_path / "q.tsv").write_text("q1\td1\t1\n")
    (tmp_path / "q.jsonl").write_text('{"_id": "q1", "text": "x"}\n')
    code = cli.main([a.format(d=d) for a in argv] + ["--server", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code != 0 and f"oprag: {message.format(d=d)}" in err, err
    assert "Errno" not in err and "Traceback" not in err


def test_an_unresolvable_server_is_named_once():
    out = subprocess.run([*oprag_cli(), "stats", "--server", "nosuchhost.invalid:50051", "--timeout", "20"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.count("nosuchhost.invalid:50051") == 1, out.stderr
    assert "give --server the server's host name or IP address" in out.stderr, out.stderr


def _closed_stdout(server, *args, unbuffered: bool):
    """``oprag ARGS`` writing into a pipe whose reader has gone (``| head -c 10`` after its 10 bytes)."""
    r, w = os.pipe()
    os.close(r)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:  # each write goes out at once (the error comes from print), else at the last flush
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run([*oprag_cli(), *args, "--server", server.target], stdout=w,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(w)


def test_stats_with_stdout_closed_exits_with_the_state_it_reports(server):
    """Last: takes shard 0 down (killed; its restarted process stopped before it is ready)."""
    old = _shard_pid(server, 0)
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: _shard_pid(server, 0) != old, 60, 0.02), "shard 0 was not restarted"
    new = _shard_pid(server, 0)
    os.kill(new, signal.SIGSTOP)
    try:
        with OpRAGClient(server.target, timeout=60) as c:
            assert wait_until(lambda: list(c.stats().missing_shards) == [0], 30)
        for args in (("stats", "--json"), ("stats",), ("query", "--no-generate", "--mode", "lexical", "evalword1")):
            for unbuffered in (True, False):
                out = _closed_stdout(server, *args, unbuffered=unbuffered)
                assert "shard(s) 0 did not answer" in out.stderr, (args, out.stderr)
                assert out.returncode == 1, (args, unbuffered, out.returncode, out.stderr)
                assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    finally:
        os.kill(new, signal.SIGCONT)
    with OpRAGClient(server.target, timeout=60) as c:
        assert wait_until(lambda: not c.stats().missing_shards, 120), "shard 0 did not come back"
    for unbuffered in (True, False):  # every shard up: 0, and no "Exception ignored" (it exited 120)
        out = _closed_stdout(server, "stats", "--json", unbuffered=unbuffered)
        assert out.returncode == 0 and not out.stderr, (unbuffered, out.returncode, out.stderr)


#: run argv[1:] with SIGINT's default disposition. Not ``preexec_fn``: that makes subprocess fork() (not vfork), and
#: this process's gRPC (the test's client) then restarts its poller in the child, which meets the epoll fd that
#: ``close_fds`` closed and aborts before the exec (CLI exit -6, "epoll_wait error: Bad file descriptor": a clean-clone
#: CI failure of session 45; grpc/grpc#43157)
_SIGINT_DEFAULT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def test_ctrl_c_during_a_multi_stream_ingest_says_what_was_committed(server, tmp_path):
    """trial28b #1: SIGINT during ``oprag ingest`` printed a KeyboardInterrupt traceback from inside
    gRPC and no summary, so the user could not tell which streams to send again. Texts the server
    embeds (so the streams take a while); SIGINT once the second stream is stored. Streams go one
    after another, so the second one's commit means the client holds the first one's acknowledgement
    (SIGINT right after the first commit could land before its reply arrived: CI failure at 0f44066).
    The CLI is started with SIGINT's default disposition (a test run started in the background by a
    shell without job control inherits SIGINT ignored). Session 37's clean-clone CI runs, all started
    that way, failed this test three times as if the SIGINT did nothing (every stream stored, exit 0;
    with 10,000 documents, still running after 60 s); not reproduced outside the full suite."""
    rows = [{"id": f"cc{i}", "text": f"interrupted ingest document {i} about rivers, harbours and keeps " * 6}
            for i in range(2000)]
    path = _jsonl(tmp_path / "cc.jsonl", rows)
    with OpRAGClient(server.target) as c:
        before = c.stats().documents
        proc = subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT, *oprag_cli(), "ingest", "--format", "jsonl",
                                 "--json", "--no-progress", "--docs-per-stream", "40", path, "--server", server.target],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = wait_until(lambda: c.stats().documents >= before + 80, timeout=120)
        finally:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        stored = c.stats().documents - before
    assert first, f"the second stream was never stored (CLI exit {proc.returncode}, stderr: {err[-1500:]!r})"
    assert stored < len(rows), "every stream was stored before the SIGINT: nothing was interrupted"
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    res = json.loads(out)
    assert res["error"]["code"] == "CANCELLED" and res["error"]["message"] == "interrupted (Ctrl-C)"
    assert res["error"]["stored"] is None and res["error"]["first_index"] == 40 * len(res["streams"])
    committed = sum(s["documents_written"] for s in res["streams"])
    assert committed >= 40 and committed < 2000
    assert stored in (committed, committed + 40)  # the cancelled stream: whole or nothing
    assert "committed (the first" in err and "interrupted (Ctrl-C)" in err


def test_ingest_summary_says_how_many_replaced_a_document(server, tmp_path):
    """trial29 #6: a second ingest under the same ids (two pipes both named ``stdin``) replaced
    the first silently: the human summary said only "ingested 2 documents"."""
    rows = [{"id": f"rep{i}", "text": f"replacement check {i}", "vector": _vec(100 + i)} for i in range(2)]
    first = _oprag(server, "ingest", "--format", "jsonl", "--no-progress", _jsonl(tmp_path / "a.jsonl", rows))
    assert first.returncode == 0, first.stderr
    assert "replaced" not in first.stdout, first.stdout
    again = _oprag(server, "ingest", "--format", "jsonl", "--no-progress", _jsonl(tmp_path / "b.jsonl", rows[:1]))
    assert again.returncode == 0, again.stderr
    assert "ingested 1 documents (1 of them replaced documents with the same id)" in again.stdout, again.stdout
