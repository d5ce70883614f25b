"""New-user trial 22 (branch fix22d), over a real server (test_fix21b's: 2 shard processes, HTTP
port, no generator): HTTP bodies in UTF-16/UTF-32 were accepted (``json.loads`` of bytes detects
them) though the README says a body that is not UTF-8 is a 400; a JSON syntax error's message gave no
byte offset; JSON nested 1,000 levels deep got FastAPI's "There was an error parsing the body" with
``code`` null. ``oprag ingest --format text /dev/stdin`` said "no such file or directory";
``--format wikitext`` dropped the text before the first heading in silence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from oprag_client.testing import oprag_cli

sys.path.insert(0, str(Path(__file__).parent))
from test_fix21b import _error, _post, server  # noqa: E402,F401 - the same real server (2 shards, HTTP, no generator)

pytestmark = pytest.mark.integration
ENDPOINTS = {"/retrieve": {"query": "bees", "top_k": 1},
             "/chat/completions": {"model": "oprag", "messages": [{"role": "user", "content": "bees"}]},
             "/embeddings": {"model": "x", "input": "bees"}}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_in_utf16_or_utf32_is_refused_as_not_utf8(server, encoding):
    body = json.dumps({"query": "bees", "top_k": 1}).encode(encoding)
    err = _error(_post(server, "/retrieve", body))
    assert err["code"] == "invalid_json" and err["message"].startswith("the body is not "), err
    assert "UTF-8" in err["message"] and "byte offset" in err["message"], err


def test_a_utf8_body_with_a_byte_order_mark_is_still_accepted(server):
    r = _post(server, "/retrieve", b"\xef\xbb\xbf" + json.dumps({"query": "bees", "top_k": 1}).encode())
    assert r.status_code == 200 and r.json()["hits"], r.text[:300]


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_malformed_json_gives_the_byte_offset(server, path):
    body = '{"query": "Zürich", "x": lobster}'.encode()  # ü is 2 bytes: the offset counts bytes, not characters
    err = _error(_post(server, path, body))
    assert err["code"] == "invalid_json", err
    assert f"byte offset {body.index(b'lobster')}: Expecting value" in err["message"], err


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@pytest.mark.parametrize("depth", [1000, 5000])
def test_json_nested_too_deeply_says_so(server, path, depth):
    body = json.dumps(ENDPOINTS[path])[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    err = _error(_post(server, path, body.encode()))
    assert err["code"] == "invalid_json" and "nested too deeply" in err["message"], err


def _oprag(server, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([*oprag_cli(), *args, "--server", server.target], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_ingest_text_from_a_pipe_reads_it(server):
    """jsonl read /dev/stdin, text said "/dev/stdin: no such file or directory"."""
    r = _oprag(server, "ingest", "--json", "--no-progress", "--format", "text", "/dev/stdin",
               stdin="The quokka of Rottnest Island smiles at pipes.\n")
    assert r.returncode == 0 and json.loads(r.stdout)["documents"] == 1, (r.stdout, r.stderr)
    hits = server.grpc.retrieve("quokka Rottnest", mode="lexical", top_k=1, min_seq=json.loads(r.stdout)["seq"]).hits
    assert hits and hits[0].doc_id == "stdin" and "quokka" in hits[0].text


def test_ingest_wikitext_says_it_skips_the_text_before_the_first_heading(server, tmp_path):
    """The paragraph before the first `` = Title = `` heading was dropped with no word."""
    f = tmp_path / "mini.txt"
    f.write_text("Intro paragraph about okapis before any heading .\nA second line .\n\n = Okapi = \n\n"
                 "The okapi is a giraffid of the Congo .\n", encoding="utf-8")
    r = _oprag(server, "ingest", "--json", "--no-progress", "--format", "wikitext", str(f))
    assert r.returncode == 0 and json.loads(r.stdout)["documents"] == 1, (r.stdout, r.stderr)
    assert (f"oprag: skipping lines 1-2 of {f}: text before its first article heading (--format wikitext reads "
            "articles, each starting with a ' = Title = ' line between blank lines)") in r.stderr, r.stderr
    hits = server.grpc.retrieve("okapi giraffid", mode="lexical", min_seq=json.loads(r.stdout)["seq"]).hits
    assert [h.doc_id for h in hits] == ["mini:Okapi"]


def test_query_no_generate_with_zero_hits_says_so(server):
    """It printed nothing at all (exit 0)."""
    r = _oprag(server, "query", "--no-generate", "--mode", "lexical", "zzyzxqv")
    assert r.returncode == 0 and r.stdout == "(no hits: the store is empty or no document matches)\n", (r.stdout, r.stderr)
