"""New-user trial 21 (branch fix21e), over a real server (test_fix21b's: 2 shard processes, HTTP
port, no generator): a vector value beyond float32's range arrives as infinity and is now refused with a
message that says so; out-of-range knobs say that 0 means the default, and over HTTP a value
beyond uint32 gets the same message as one just over the bound; ``GET /v1/models/`` (a trailing
slash) was a 307 with an empty body; the metrics a real scrape exports are the README table's."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import grpc
import pytest
import requests

from oprag_client.client import Doc

sys.path.insert(0, str(Path(__file__).parent))
from test_fix21b import server  # noqa: E402,F401 - the same real server (2 shards, HTTP, no generator)

pytestmark = pytest.mark.integration
DIM = 384  # MiniLM, the default embedder
README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
HINT = "float32 holds at most about 3.4e38 in magnitude: a larger value arrives as infinity"


def test_a_vector_value_beyond_float32_is_refused_saying_it_overflowed(server):
    """1e39 is finite, but the wire's float32 makes it infinity: the message said only "contains
    NaN or infinity", which the sender of 1e39 could not recognise."""
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.ingest([Doc("huge", "a", vector=[1e39] * DIM)])
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "contains NaN or infinity" in ei.value.details() and HINT in ei.value.details(), ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        server.grpc.retrieve("bees", query_vector=[1e39] * DIM)
    assert ei.value.details() == f"query_vector contains NaN or infinity ({HINT})"


def test_grpc_range_messages_say_zero_is_the_default(server):
    for kw, want in ((dict(top_k=101), "top_k must be in [1, 100] (0 = the default), got 101"),
                     (dict(candidates=5000), "candidates must be in [1, 4096] (0 = the default), got 5000")):
        with pytest.raises(grpc.RpcError) as ei:
            server.grpc.retrieve("bees", **kw)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details() == want
    assert server.grpc.retrieve("bees", top_k=0).hits  # 0: the default, as the message says


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                         timeout=60)


@pytest.mark.parametrize("field, big, small, rng", [("top_k", 10**12, 101, "[1, 100] (0 = the default)"),
                                                     ("candidates", 2**40, 4097, "[1, 4096] (0 = the default)"),
                                                     ("ef_search", 2**32, 65537, "[0, 65536]")])
def test_http_knob_beyond_uint32_gets_the_message_of_one_just_over_the_bound(server, field, big, small, rng):
    """oprag.top_k 1e12 said "must be at most 4294967295" (the wire type's bound), 101 "[1, 100]"."""
    for v in (small, big):
        r = _post(server, "/retrieve", {"query": "bees", field: v})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"{field} must be in {rng}, got {v}" and r.json()["error"]["param"] == field
        r = _post(server, "/chat/completions", {"model": "oprag", "messages": [{"role": "user", "content": "x"}],
                                                "oprag": {field: v}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["message"] == f"{field} must be in {rng}, got {v}", r.text
        assert err["param"] == f"oprag.{field}"


def test_get_models_with_a_trailing_slash_lists_the_models(server):
    r = requests.get(server.url + "/models/", timeout=30, allow_redirects=False)
    assert r.status_code == 200, (r.status_code, r.headers, r.text)  # was 307 with an empty body
    assert r.json() == requests.get(server.url + "/models", timeout=30).json() and r.json()["data"]


def test_a_real_scrape_exports_the_readme_table_metrics(server):
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
    scraped = {n for n in re.findall(r"^# TYPE (oprag_\w+) ", text, re.M) if not n.endswith("_created")}
    section = README.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    table = {n for r in section.splitlines() if r.startswith("| `oprag_") for n in re.findall(r"`(oprag_\w+)", r.split(" | ")[0])}
    assert scraped == table, (sorted(scraped - table), sorted(table - scraped))
