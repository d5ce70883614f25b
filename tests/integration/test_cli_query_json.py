"""``oprag query --json`` against a real server (2 shards, no generator): the reply's
``retrieval`` (RetrievalInfo) under its proto field names, each hit's ``dense_rank`` /
``lexical_rank`` as the Python client's Retrieve returns them, and ``--fusion`` /
``--dense-weight`` / ``--lexical-weight`` / ``--rrf-k`` (README: oprag query --json).
Before: no retrieval info, no ranks, no way to choose the fusion at the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess
from test_fix21a_cli import _oprag, _vec  # (tests/integration is on sys.path)

pytestmark = [pytest.mark.integration]

N_DOCS = 40
QUESTION = "lobster habitat"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Documents with their own vectors (nothing embedded at ingest): one in five says "lobster"
    (a term in half of them would have a BM25 idf of 0), one in ten "habitat" too; in full_hybrid
    the others are hits in the dense list only (lexical_rank 0)."""
    srv = ServerProcess.on_free_ports(tmp_path_factory.mktemp("cli-json-data"), "--generator", "none", "--shards", "2")
    srv.start()
    docs = [Doc(f"d{i}", (f"the lobster lives in a rocky{' habitat' if i % 10 == 0 else ''}, note {i}" if i % 5 == 0
                          else f"a kite flies over the sea on a windy day, note {i}"),
                title=f"doc {i}", vector=np.asarray(_vec(1000 + i), np.float32), metadata=_meta(i)) for i in range(N_DOCS)]
    with OpRAGClient(srv.target, timeout=120) as c:
        assert c.ingest(docs).documents_written == N_DOCS
    yield srv
    srv.stop()


def _meta(i: int) -> dict:
    return {"n": i, "even": i % 2 == 0, "tag": f"t{i}", "w": i / 4}


def _query(server, *args):
    out = _oprag(server, "query", "--json", "--no-generate", *args, QUESTION)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)


RETRIEVAL_FIELDS = [f.name for f in oprag_pb2.RetrievalInfo.DESCRIPTOR.fields]


def test_json_has_every_retrieval_field_and_default_hybrid_is_weighted_minmax(server):
    res = _query(server)
    info = res["retrieval"]
    assert list(info) == RETRIEVAL_FIELDS  # every field, proto names, proto order (defaults included)
    assert (info["mode"], info["fusion"]) == ("hybrid", "weighted_minmax")
    assert (info["dense_weight"], info["lexical_weight"], info["rrf_k"]) == (0.5, 0.5, 0)
    # min-max hybrid on the default flat index starts from max(64, 4 x top_k) (README: dense-first hybrid)
    assert info["candidates"] == 64
    assert info["chunks_searched"] == N_DOCS and isinstance(info["chunks_searched"], int)
    assert (info["partial"], info["missing_shards"], info["dense_index"]) == (False, [], "flat")
    assert info["certified"] is True and info["lexical_candidates"] > 0
    assert res["missing_shards"] == []  # the old top-level key stays


def test_fusion_rrf_and_weights_reach_the_server(server):
    info = _query(server, "--fusion", "rrf")["retrieval"]
    assert (info["mode"], info["fusion"], info["candidates"], info["rrf_k"]) == ("hybrid", "rrf", 256, 60)
    info = _query(server, "--fusion", "rrf", "--rrf-k", "10", "--mode", "full_hybrid")["retrieval"]
    assert (info["mode"], info["fusion"], info["rrf_k"]) == ("full_hybrid", "rrf", 10)
    info = _query(server, "--fusion", "minmax", "--dense-weight", "0.25", "--lexical-weight", "0.75")["retrieval"]
    assert (info["fusion"], info["dense_weight"], info["lexical_weight"]) == ("weighted_minmax", 0.25, 0.75)
    info = _query(server, "--mode", "dense")["retrieval"]
    assert (info["mode"], info["fusion"]) == ("dense", "none")


@pytest.mark.parametrize("args, kw", [
    ((), {}),
    (("--fusion", "rrf"), dict(fusion="rrf")),
    (("--mode", "full_hybrid", "--top-k", "30"), dict(mode="full_hybrid", top_k=30)),
    (("--mode", "full_hybrid", "--top-k", "30", "--fusion", "rrf", "--dense-weight", "2", "--lexical-weight", "1"),
     dict(mode="full_hybrid", top_k=30, fusion="rrf", dense_weight=2.0, lexical_weight=1.0)),
])
def test_hit_ranks_are_those_of_the_client_retrieve(server, args, kw):
    res = _query(server, *args)
    with OpRAGClient(server.target, timeout=60) as c:
        r = c.retrieve(QUESTION, **kw)
    want = [(h.chunk_id, h.dense_rank, h.lexical_rank) for h in r.hits]
    got = [(h["chunk_id"], h["dense_rank"], h["lexical_rank"]) for h in res["hits"]]
    assert got == want
    assert any(d > 0 for _, d, _ in got) and any(x > 0 for _, _, x in got)
    if kw.get("mode") == "full_hybrid":  # the kite documents hold no query term: not in the lexical list
        assert {x for cid, _, x in got if int(cid.split("#")[0][1:]) % 5} == {0}
        assert all(x > 0 for cid, _, x in got if int(cid.split("#")[0][1:]) % 5 == 0)
        assert all(d > 0 for _, d, _ in got)  # 30 hits of a window of 256: all in the dense list


def test_query_rpc_json_has_retrieval_too(server):
    out = _oprag(server, "query", "--json", "--fusion", "rrf", QUESTION)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["finish_reason"] == "no_generator" and res["retrieval"]["fusion"] == "rrf"
    assert res["hits"] and all("dense_rank" in h and "lexical_rank" in h for h in res["hits"])


@pytest.mark.parametrize("args, code, message", [
    (("--fusion", "bogus"), 2, "argument --fusion: invalid choice: 'bogus'"),
    (("--dense-weight", "-1"), 2, "argument --dense-weight: must be a finite number >= 0, got -1"),
    (("--lexical-weight", "nan"), 2, "argument --lexical-weight: must be a finite number >= 0, got nan"),
    (("--rrf-k", "-3"), 2, "argument --rrf-k: must be >= 0, got -3"),
    (("--mode", "dense", "--fusion", "rrf"), 2,
     "oprag: --fusion: fusion applies to --mode hybrid and full_hybrid only (--mode dense ranks one list)"),
    (("--mode", "lexical", "--dense-weight", "1"), 2, "oprag: --dense-weight: fusion applies to --mode hybrid"),
    (("--rrf-k", "10"), 2, "oprag: --rrf-k needs --fusion rrf"),
    (("--fusion", "rrf", "--rrf-k", str(2**32)), 2, "argument --rrf-k: must be at most 100000, got 4294967296"),
    (("--fusion", "rrf", "--rrf-k", "100001"), 2, "argument --rrf-k: must be at most 100000, got 100001"),
    (("--max-new-tokens", "32"), 2, "oprag: --max-new-tokens: --no-generate generates no answer"),
    (("--stop", "Observation:"), 2, "oprag: --stop: --no-generate generates no answer"),
    (("--no-memory",), 2, "oprag: --no-memory needs --session"),
    (("--mode", "lexical", "--candidates", "1000"), 2,
     "oprag: --candidates: the window N applies to --mode hybrid and full_hybrid only (--mode lexical ranks one list"),
    (("--mode", "lexical", "--ef-search", "400"), 2,
     "oprag: --ef-search: the approximate dense search's knob applies to --mode hybrid and dense only (--mode lexical"),
    (("--mode", "full_hybrid", "--nprobe", "8"), 2, "oprag: --nprobe: the approximate dense search's knob applies"),
    (("--dense-weight", "1e7"), 1,
     "oprag: INVALID_ARGUMENT: fusion.dense_weight must be 0 or a number in [1e-12, 1e6], got 10000000.0"),
])
def test_a_bad_fusion_option_is_a_clean_error(server, args, code, message):
    out = _oprag(server, "query", "--json", "--no-generate", *args, QUESTION)
    assert out.returncode == code, (out.returncode, out.stderr)
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    err = json.loads(out.stdout)["error"]  # (one JSON object on stdout also when it fails: trial39 #5)
    assert err["code"] == ("USAGE" if code == 2 else "INVALID_ARGUMENT") and err["message"], err


def test_query_stop_strings_reach_the_server_and_its_checks(server):
    """``--stop`` is GenerationOptions.stop: checked by the server also when it has no generator to cut."""
    out = _oprag(server, "query", "--json", "--stop", "a", "--stop", "b", QUESTION)
    assert out.returncode == 0 and json.loads(out.stdout)["finish_reason"] == "no_generator", out.stderr
    out = _oprag(server, "query", "--json", *[a for i in range(5) for a in ("--stop", f"s{i}")], QUESTION)
    assert out.returncode == 1 and "stop has 5 strings; at most 4 are allowed" in out.stderr, out.stderr
    assert json.loads(out.stdout)["error"]["code"] == "INVALID_ARGUMENT"


def test_each_hit_carries_its_typed_metadata(server):
    """The hits' metadata in JSON types (integers, booleans, floats, strings), as ingested."""
    hits = _query(server, "--top-k", "8")["hits"]
    assert hits
    for h in hits:
        want = _meta(int(h["doc_id"][1:]))
        assert h["metadata"] == want and all(type(h["metadata"][k]) is type(v) for k, v in want.items())
        assert list(h["metadata"]) == sorted(want)  # the same output for the same reply (maps have no order)


@pytest.mark.parametrize("mode", ["dense", "lexical"])
def test_retrieval_says_no_fusion_ran_in_a_one_list_mode(server, mode):
    """DENSE / LEXICAL rank one list: ``retrieval`` reports fusion none with weights and rrf_k 0
    (they read 0.5 / 0.5 before, as if a fusion had run: trial34), also when the Python client
    sends fusion settings there (accepted and ignored, README)."""
    info = _query(server, "--mode", mode)["retrieval"]
    assert (info["mode"], info["fusion"], info["dense_weight"], info["lexical_weight"], info["rrf_k"]) == \
        (mode, "none", 0.0, 0.0, 0)
    with OpRAGClient(server.target) as c:
        r = c.retrieve(QUESTION, mode=mode, fusion="rrf", dense_weight=0.2, lexical_weight=0.8, rrf_k=7)
    assert (r.retrieval.fusion, r.retrieval.dense_weight, r.retrieval.lexical_weight, r.retrieval.rrf_k) == ("none", 0, 0, 0)


def test_the_clis_rrf_k_limit_is_the_servers():
    from oprag_client.cli import MAX_RRF_K
    from oprag_client.client import MAX_KNOB
    from oprag_server.service.convert import MAX_KNOB as SERVER_MAX_KNOB
    from oprag_server.service.convert import MAX_RRF_K as SERVER_MAX_RRF_K

    assert (MAX_RRF_K, MAX_KNOB) == (SERVER_MAX_RRF_K, SERVER_MAX_KNOB)
