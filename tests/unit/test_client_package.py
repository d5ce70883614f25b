"""The client package stands alone: it imports nothing from oprag_server, installs and runs
without torch, and finds `oprag serve` only through the `oprag.commands` entry point group."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"
# torch and the server are made unimportable in the child before the client is imported
BLOCK = "import sys; sys.modules['torch'] = None; sys.modules['oprag_server'] = None; "


def _run(code: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([sys.executable, "-c", BLOCK + code], env=env, capture_output=True, text=True, timeout=120)


def test_client_sources_never_import_the_server():
    found = []
    for path in sorted(CLIENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and (getattr(node.func, "attr", "") == "import_module"
                                                 or getattr(node.func, "id", "") == "__import__"):
                # importlib / __import__ by name (a subprocess running `python -m oprag_server`,
                # as the launcher in oprag_client.testing does, imports nothing into the client)
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "oprag_server"]
    assert found == []


def test_client_cli_runs_without_torch_or_server():
    r = _run("from oprag_client.cli import main; import sys; "
             "rc = main(['serve']); print('RC', rc); "
             "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]", [CLIENT])
    assert r.returncode == 0, r.stderr
    assert "RC 2" in r.stdout and "comes with the server" in r.stderr
    # as in a client-only install, where no distribution registers `serve`
    h = _run("import oprag_client.cli as c; c._plugins = dict; c.main(['--help'])", [CLIENT])
    assert h.returncode == 0, h.stderr
    assert "query" in h.stdout and "ingest" in h.stdout and "serve" not in h.stdout


def test_serve_is_found_through_the_entry_point_group(tmp_path):
    dist = tmp_path / "oprag_fake-0.1.dist-info"  # what `pip install .` of the full package writes
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: oprag-fake\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[oprag.commands]\nserve = oprag_server.cli:main\n")
    code = "sys.modules.pop('oprag_server'); from oprag_client.cli import main; main({argv!r})"
    h = _run(code.format(argv=["--help"]), [tmp_path, ROOT / "server", CLIENT])
    assert h.returncode == 0, h.stderr
    assert "serve" in h.stdout
    s = _run(code.format(argv=["serve", "--help"]), [tmp_path, ROOT / "server", CLIENT])
    assert s.returncode == 0, s.stderr  # the serve options need no torch either
    assert s.stdout.startswith("usage: oprag serve") and "--chunk-size" in s.stdout and "(default: 256)" in s.stdout


def test_client_wheel_holds_only_the_client_and_installs_without_torch(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "client"  # a copy: setuptools leaves build/ and *.egg-info in the source tree
    shutil.copytree(CLIENT, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "whl"), str(src)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (whl,) = (tmp_path / "whl").glob("oprag_client-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert {n.split("/")[0] for n in names} == {"oprag", "oprag_client", whl.name.split("-py3")[0] + ".dist-info"}
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta.splitlines()  # the SPDX form (the table form is deprecated)
    deps = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    name = lambda d: d.split(">")[0].split("<")[0].split(";")[0].strip()  # noqa: E731
    assert sorted(name(d) for d in deps if "extra ==" not in d) == ["grpcio", "grpcio-health-checking", "protobuf", "tqdm"]
    # the columnar loaders' extra (oprag ingest --format parquet|arrow), not installed by default
    assert sorted(name(d) for d in deps if "extra ==" in d) == ["numpy", "pyarrow"]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(whl)], check=True, capture_output=True, timeout=300)
    r = _run("from oprag_client.cli import main; main(['--help'])", [target])
    assert r.returncode == 0, r.stderr
    assert "usage: oprag" in r.stdout
