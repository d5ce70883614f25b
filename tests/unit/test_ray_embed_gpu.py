"""Where the ingest embedding actors go (``--ray-embed-gpus``): one per GPU with ``num_gpus=1``
and the encoder on ``cuda`` when the Ray cluster reports GPUs, CPU actors exactly as before
when it reports none. This machine has no GPU: the decision and the actor options are checked
against a stand-in ``ray`` module; the CPU actor body runs for real."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from oprag_server.config import RayConfig, ServerConfig
from oprag_server.engine.ray_embed import ActorPlan, EmbedActor, plan_actors, start_embed_pool


@pytest.mark.parametrize("actors,gpus_flag,cluster_gpus,want", [
    (-1, "auto", 0, ActorPlan(-1, 1.0, 0.0, "auto", True)),  # CPU-only cluster: unchanged
    (3, "auto", 0, ActorPlan(3, 1.0, 0.0, "auto", False)),
    (-1, "auto", 4, ActorPlan(4, 1.0, 1.0, "cuda", True)),  # one per GPU
    (-1, "auto", 0.5, ActorPlan(-1, 1.0, 0.0, "auto", True)),  # a fraction of a GPU is no GPU actor
    (2, "auto", 4, ActorPlan(2, 1.0, 1.0, "cuda", False)),  # asked for 2: 2 GPU actors, all placed
    (-1, "0", 4, ActorPlan(-1, 1.0, 0.0, "auto", True)),  # GPUs there, CPU actors asked for
    (-1, "2", 0, ActorPlan(2, 1.0, 1.0, "cuda", False)),  # explicit count: placed or a start-up error
])
def test_plan(actors, gpus_flag, cluster_gpus, want):
    assert plan_actors(actors, gpus_flag, 1.0, "auto", cluster_gpus) == want


def test_no_actors_and_bad_flag():
    assert plan_actors(0, "auto", 1.0, "auto", 8) is None
    with pytest.raises(ValueError, match="GPUs"):
        RayConfig(embed_gpus="many")


class _FakeRay(types.ModuleType):
    """Just what RayEmbedPool calls: resources, nodes, remote().options().remote(), wait, get, kill."""

    def __init__(self, gpus: float, cpu_nodes: int) -> None:
        super().__init__("ray")
        self.gpus, self.cpu_nodes, self.options, self.made, self.killed = gpus, cpu_nodes, None, [], []

    def cluster_resources(self):
        return {"CPU": 8.0, **({"GPU": self.gpus} if self.gpus else {})}

    def nodes(self):
        return [{"Alive": True, "Resources": {"CPU": 2.0}}] * self.cpu_nodes + [{"Alive": True, "Resources": {}}]

    def remote(self, cls):
        assert cls is EmbedActor
        ray = self

        class Cls:
            def options(self, **kw):
                ray.options = kw
                return self

            def remote(self, model, threads, kw):
                ray.made.append((model, threads, kw))
                h = types.SimpleNamespace()
                h.usage = types.SimpleNamespace(remote=lambda: {"node": f"n{len(ray.made)}"})
                return h

        return Cls()

    def wait(self, refs, num_returns, timeout):
        return list(refs), []

    def get(self, refs, timeout=None):
        return list(refs)

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


def _encoder():
    return types.SimpleNamespace(path=Path("/models/minilm"), max_tokens=256, _requested_dtype="auto")


def test_gpu_cluster_gets_one_actor_per_gpu_on_cuda(monkeypatch):
    fake = _FakeRay(gpus=2.0, cpu_nodes=3)
    monkeypatch.setitem(sys.modules, "ray", fake)
    pool = start_embed_pool(ServerConfig(ray=RayConfig(address="auto")), _encoder())
    assert pool.n == 2 and len(fake.made) == 2
    assert fake.options["num_gpus"] == 1.0 and fake.options["num_cpus"] == 1.0
    assert fake.options["max_task_retries"] == 0 and fake.options["max_restarts"] == -1
    assert {m[2]["device"] for m in fake.made} == {"cuda"} and {m[2]["dtype"] for m in fake.made} == {"auto"}


def test_cpu_only_cluster_is_unchanged(monkeypatch):
    fake = _FakeRay(gpus=0, cpu_nodes=3)
    monkeypatch.setitem(sys.modules, "ray", fake)
    pool = start_embed_pool(ServerConfig(ray=RayConfig(address="auto")), _encoder())
    assert pool.n == 3 and "num_gpus" not in fake.options  # one per node with CPUs
    assert {m[2]["device"] for m in fake.made} == {"auto"}  # the frontend's setting (Ray hides GPUs)
    fake2 = _FakeRay(gpus=4.0, cpu_nodes=3)
    monkeypatch.setitem(sys.modules, "ray", fake2)
    pool = start_embed_pool(ServerConfig(ray=RayConfig(address="auto", embed_gpus="0")), _encoder())
    assert pool.n == 3 and "num_gpus" not in fake2.options
    assert start_embed_pool(ServerConfig(ray=RayConfig(address="auto", embed_actors=0)), _encoder()) is None
    assert start_embed_pool(ServerConfig(), _encoder()) is None  # no --ray-address


def test_the_cpu_actor_body_embeds_as_the_frontend_does():
    from oprag_server.models.encoder import TransformersEncoder

    enc = TransformersEncoder("minilm", device="cpu")
    actor = EmbedActor(str(enc.path), 1, {"device": "cpu", "max_tokens": enc.max_tokens, "dtype": "auto"})
    assert actor.encoder.device == "cpu" and actor.encoder.dtype == "float32"
    ids = enc.tokenize(["high water at the harbour", "the keeper logged the wind"])
    np.testing.assert_allclose(actor.encode(ids), enc.encode_tokenized(ids), atol=1e-6)
    assert actor.chunks == 2
