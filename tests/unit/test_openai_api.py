"""Request shapes of the OpenAI-compatible HTTP API (service/openai_api.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from oprag_server.service.openai_api import ChatRequest, EmbeddingsRequest, RetrieveRequest


@pytest.mark.parametrize("bad", ["\ud800", "a\udfffb"])
def test_lone_surrogates_are_refused_in_every_string_field(bad):
    # JSON may carry them as escapes ("\ud800"); no UTF-8 consumer takes them (found by the HTTP fuzz: a 500)
    assert json.loads(json.dumps(bad)) == bad
    for model, body in [(RetrieveRequest, {"query": bad}),
                        (RetrieveRequest, {"query": "q", "filters": {bad: ["x"]}}),
                        (RetrieveRequest, {"query": "q", "filters": {"k": [bad]}}),
                        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": bad}]}),
                        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": bad}]}]}),
                        (EmbeddingsRequest, {"model": "m", "input": ["ok", bad]})]:
        with pytest.raises(ValidationError, match="unpaired surrogate"):
            model.model_validate(body)


def test_valid_unicode_passes():
    assert RetrieveRequest.model_validate({"query": "中文 🦀 é"}).query == "中文 🦀 é"


def test_http_metric_labels_stay_bounded():
    from oprag_server.service.http import _metric_method

    assert _metric_method("/v1/chat/completions") == "HTTP /v1/chat/completions"
    assert _metric_method("/v1/models/oprag") == "HTTP /v1/models"
    for path in ("/v1/x1", "/v1/x2", "/v1/models/a/b", "/", "/v1/chat/completions/x"):
        assert _metric_method(path) == "HTTP other"



def _job(reason: str):
    from oprag_server.domain import RetrieveSpec
    from oprag_server.engine.job import QueryJob

    job = QueryJob(question="q", spec=RetrieveSpec(), generate=False)
    job.finish_reason = reason
    return job


def test_finish_reason_no_generator_is_reported_in_the_extension():
    from oprag_server.service import openai_api as api

    job = _job("no_generator")
    assert api.finish_reason(job) == "stop"  # OpenAI's enum has nothing closer
    assert api.extension(job, include_trace=False)["finish_reason"] == "no_generator"
    assert api.extension(_job("length"), include_trace=False)["finish_reason"] == "length"
    assert api.finish_reason(_job("length")) == "length"


def test_filters_take_a_single_value_or_a_list():
    from oprag_server.service.openai_api import query_request

    one = RetrieveRequest.model_validate({"query": "q", "filters": {"lang": "en", "year": 2020}})
    many = RetrieveRequest.model_validate({"query": "q", "filters": {"lang": ["en"], "year": [2020]}})
    a, b = query_request("q", one).filters, query_request("q", many).filters
    assert a == b and len(a) == 2 and all(len(f.typed_values) == 1 for f in a)
    with pytest.raises(ValidationError):
        RetrieveRequest.model_validate({"query": "q", "filters": {"lang": {"nested": 1}}})


@pytest.mark.parametrize("missing", [[], [1]])
def test_http_retrieval_says_partial_as_grpc_does(missing):
    """trial14: with a shard down, /v1/retrieve and the chat extension had missing_shards but no
    ``partial``, which the README promises (gRPC's RetrievalInfo.partial)."""
    from oprag_server.domain import RetrievalInfo
    from oprag_server.service import openai_api as api

    job = _job("stop")
    job.info = RetrievalInfo(mode="hybrid", fusion="weighted_minmax", dense_weight=0.5, lexical_weight=0.5, rrf_k=0,
                             candidates=256, missing_shards=missing)
    r = api.extension(job, include_trace=False)["retrieval"]
    assert r["partial"] is bool(missing) and r["missing_shards"] == missing
