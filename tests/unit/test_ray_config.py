"""The Ray transport's configuration: CLI flags reach RayConfig, bad values are refused, and
the default path (no --ray-address) neither imports Ray nor changes the shard transport."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oprag_server.cli import build_parser, config_from_args
from oprag_server.config import RayConfig, ServerConfig


def test_flags_reach_the_ray_config():
    cfg = config_from_args(build_parser().parse_args(
        ["--ray-address", "auto", "--ray-strategy", "STRICT_SPREAD", "--ray-max-restarts", "3", "--ray-shard-cpus", "0.5"]))
    assert cfg.ray == RayConfig(address="auto", strategy="STRICT_SPREAD", max_restarts=3, shard_cpus=0.5)
    assert config_from_args(build_parser().parse_args([])).ray.address is None


@pytest.mark.parametrize("kw", [{"strategy": "EVERYWHERE"}, {"channel": "grpc"}, {"max_restarts": -2}, {"shard_cpus": 0}, {"ping_s": 0}])
def test_bad_values_are_refused(kw):
    with pytest.raises(ValueError):
        RayConfig(**kw)


def test_default_path_needs_no_ray():
    code = ("import sys; from oprag_server.shards.pool import placement as _placement; from oprag_server.app import Runtime; from oprag_server.config import ServerConfig;"
            "assert _placement(ServerConfig()) == {}; import oprag_server.shards.ray_transport;"
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ray_address_selects_the_ray_placement():
    from oprag_server.shards.pool import placement as _placement
    from oprag_server.shards.ray_transport import RayPlacement

    p = _placement(ServerConfig(ray=RayConfig(address="local"), shards=3))["transport"]
    assert isinstance(p, RayPlacement) and p.n == 3 and p.pg is None  # nothing started before the pool starts


def test_embedding_actor_flags_reach_the_ray_config():
    cfg = config_from_args(build_parser().parse_args(["--ray-embed-actors", "3", "--ray-embed-cpus", "0.5"]))
    assert cfg.ray.embed_actors == 3 and cfg.ray.embed_cpus == 0.5
    assert RayConfig().embed_actors == -1  # with Ray on: one embedding actor per node
    for kw in ({"embed_actors": -2}, {"embed_cpus": 0}):
        with pytest.raises(ValueError):
            RayConfig(**kw)
