"""Generator backend selection (CLI -> config -> factory), engine error statuses, the engine
health hook and the prompt layout for prefix caches. No model is loaded here."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from oprag_server import cli
from oprag_server.domain import Hit
from oprag_server.models.backends import API_KEY_ENV, load_backend
from oprag_server.models.fakes import EchoGenerator
from oprag_server.models.managed_engine import TransformersServeGenerator
from oprag_server.models.openai_engine import OpenAIGenerator
from oprag_server.models.protocols import EngineRejected, EngineTimeout, EngineUnavailable
from oprag_server.operators.context import SYSTEM_PROMPT, build_context
from oprag_server.service.interceptors import status_for
from oprag_server.supervision import NOT_SERVING, QUERY_HEALTH, SERVING, EngineHealth


def cfg(*argv: str):
    return cli.config_from_args(cli.build_parser().parse_args(list(argv)))


def test_openai_flags_reach_the_backend(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    c = cfg("--generator", "openai", "--generator-url", "http://engine:8000/v1", "--generator-model", "llama",
            "--generator-api-key-file", str(key), "--generator-tls-verify", "false", "--generator-timeout-s", "7",
            "--generator-max-inflight", "3")
    g = load_backend(c.generate)
    assert isinstance(g, OpenAIGenerator) and c.generate.engine
    assert (g.url, g.model, g.api_key, g.tls_verify, g.timeout_s, g.max_inflight) == (
        "http://engine:8000/v1", "llama", "sk-test", False, 7.0, 3)
    assert g.tokenizer_dir is None  # not a local directory: the documented estimate
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert load_backend(cfg("--generator", "openai", "--generator-url", "http://e/v1",
                            "--generator-model", "m").generate).api_key == "from-env"


def test_bad_engine_settings_are_refused():
    with pytest.raises(ValueError, match="generator-url"):
        cfg("--generator", "openai")
    with pytest.raises(ValueError, match="tls-verify"):
        load_backend(cfg("--generator", "openai", "--generator-url", "http://e/v1", "--generator-model", "m",
                         "--generator-tls-verify", "/no/such/ca.pem").generate)
    with pytest.raises(ValueError, match="http"):
        OpenAIGenerator("engine:8000", "m")


def test_transformers_serve_and_builtin_backends(tmp_path):
    g = load_backend(cfg("--generator", "transformers-serve", "--generator-continuous-batching").generate, tmp_path)
    assert isinstance(g, TransformersServeGenerator) and g._engine_kw["continuous_batching"] is True
    assert g.engine is None  # nothing started before warm_up
    assert load_backend(cfg("--generator", "none").generate) is None
    assert type(load_backend(cfg("--generator", "builtin").generate)).__name__ == "HFGenerator"
    assert not cfg().generate.engine  # the builtin stays the default


@pytest.mark.parametrize("exc, code, trailer", [
    (EngineUnavailable("down", 2.5), grpc.StatusCode.UNAVAILABLE, (("retry-after-ms", "2500"),)),
    (EngineTimeout("slow"), grpc.StatusCode.DEADLINE_EXCEEDED, ()),
    (EngineRejected("too long"), grpc.StatusCode.INVALID_ARGUMENT, ()),
])
def test_engine_errors_map_to_statuses(exc, code, trailer):
    got_code, _, got_trailer = status_for(exc, "Query")
    assert (got_code, got_trailer) == (code, trailer)


class _Health:
    def __init__(self):
        self.set_to: list = []

    async def set(self, name, status):
        self.set_to.append((name, status))


class _Gen:
    def __init__(self):
        self.healthy, self.up, self.probes = True, True, 0

    async def probe(self):
        self.probes += 1
        self.healthy = self.up
        return self.up


def test_engine_health_turns_the_query_path_not_serving_and_back():
    gen, health = _Gen(), _Health()
    eh = EngineHealth(gen, health)

    async def main():
        await eh.check(probe=False)
        gen.healthy = gen.up = False  # a request failed; the engine does not answer
        await eh.check(probe=False)
        gen.up = True
        await eh.check(probe=False)

    asyncio.run(main())
    assert health.set_to == [(QUERY_HEALTH, SERVING), (QUERY_HEALTH, NOT_SERVING), (QUERY_HEALTH, SERVING)]
    assert gen.probes == 2  # probed only while it looked down


def test_prompt_puts_stable_parts_first_and_carries_chat_messages():
    hits = [Hit(f"c{i}", f"d{i}", f"T{i}", f"text {i}", 1.0, 1.0, 1.0, 0) for i in range(2)]
    p = build_context("why?", hits, EchoGenerator(), budget_tokens=500, max_new_tokens=10, memory_text="we talked")
    user = p.messages[1]["content"]
    assert p.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert user.index("we talked") < user.index("[1] T0") < user.index("[2] T1") < user.index("Question: why?")
    assert p.prompt == EchoGenerator().chat_prompt(SYSTEM_PROMPT, user)
