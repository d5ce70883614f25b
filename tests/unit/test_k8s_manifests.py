"""deploy/k8s/ matches the code: every manifest parses; the frontend's `oprag serve` command
line parses with the server's own CLI parser; its ports, the Service, the Prometheus scrape
annotations and the probes agree with it; every pod uses the one image the README and the
Dockerfile build, and mounts the shared volume at the frontend's --data-dir."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="needs PyYAML (dev extra)")

from oprag_server.cli import build_parser, config_from_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
IMAGE = "oprag:ray"


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    files = sorted(K8S.glob("*.yaml"))
    assert files, "no manifests in deploy/k8s"
    for f in files:
        for d in yaml.safe_load_all(f.read_text()):
            assert d and {"apiVersion", "kind", "metadata"} <= set(d), f
            out[(d["kind"], d["metadata"]["name"])] = d
    return out


def _pod_specs(docs: dict) -> dict[str, dict]:
    rc = docs[("RayCluster", "oprag-ray")]["spec"]
    pods = {"head": rc["headGroupSpec"]["template"], "frontend": docs[("Deployment", "oprag-frontend")]["spec"]["template"]}
    for g in rc["workerGroupSpecs"]:
        pods[g["groupName"]] = g["template"]
    return pods


def _serve_cfg(container: dict):
    script = " ".join(container.get("command", []) + container.get("args", []))
    argv = shlex.split(script.split("exec oprag serve", 1)[1])
    return config_from_args(build_parser().parse_args(argv))


def test_frontend_flags_ports_and_scrape_annotations_match_the_cli():
    docs = _docs()
    dep = docs[("Deployment", "oprag-frontend")]["spec"]["template"]
    (c,) = dep["spec"]["containers"]
    cfg = _serve_cfg(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": cfg.port, "metrics": cfg.metrics_port}
    assert cfg.host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"
    assert cfg.ray.address == "auto" and cfg.shards >= 2
    assert "ray start --address=oprag-ray-head-svc:6379" in c["args"][0]  # KubeRay's head service of 'oprag-ray'
    ann = dep["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == cfg.metrics_port
    assert c["readinessProbe"]["grpc"]["port"] == cfg.port
    svc = docs[("Service", "oprag")]["spec"]
    assert svc["selector"].items() <= dep["metadata"]["labels"].items()
    assert {(p["port"], p["targetPort"]) for p in svc["ports"]} == {(cfg.port, "grpc"), (cfg.metrics_port, "metrics")}
    assert docs[("Deployment", "oprag-frontend")]["spec"]["replicas"] == 1  # one commit log owner


def test_every_pod_uses_the_image_and_mounts_the_shared_volume_at_the_data_dir():
    docs = _docs()
    pvc = docs[("PersistentVolumeClaim", "oprag-data")]["spec"]
    assert pvc["accessModes"] == ["ReadWriteMany"]
    pods = _pod_specs(docs)
    assert {"head", "frontend"} < set(pods)
    data_dir = str(_serve_cfg(pods["frontend"]["spec"]["containers"][0]).data_dir)
    for name, pod in pods.items():
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]}
        for c in pod["spec"]["containers"]:
            assert c["image"] == IMAGE, name
            mounts = {m["mountPath"]: claims[m["name"]] for m in c["volumeMounts"]}
            assert mounts.get(data_dir) == "oprag-data", (name, mounts)
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true", name
    rc = docs[("RayCluster", "oprag-ray")]["spec"]
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no shard on the head


def test_the_image_is_built_as_documented():
    assert "ARG OPRAG_EXTRAS" in (ROOT / "Dockerfile").read_text()
    build = f"docker build -t {IMAGE} --build-arg OPRAG_EXTRAS=ray ."
    assert build in (ROOT / "README.md").read_text()
    assert build in (K8S / "raycluster.yaml").read_text()
