"""The import layering of docs/architecture.md holds: no server module imports from a layer
above it, and the client package imports nothing from the server."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "oprag_server"
CLIENT = ROOT / "client" / "oprag_client"

# Lowest first; a module may import from its own layer and the ones below it.
LAYERS = {
    "domain": 0, "config": 0, "records": 0, "metadata": 0,
    "index": 1,
    "shards": 2, "models": 2,
    "operators": 3,
    "engine": 4,
    "service": 5,
}
COMPOSITION = 6  # app.py, cli.py, __main__.py and other top-level wiring modules


def _layer(parts: tuple[str, ...]) -> int:
    head = parts[0] if parts else ""
    return LAYERS.get(head, COMPOSITION)


def _imports(path: Path, package: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Module paths (relative to oprag_server) imported by ``path``, absolute and relative."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = tuple(node.module.split(".")) if node.module else ()
                target = base + mod
                names = [target + (a.name,) for a in node.names] if not node.module else [target]
                out.extend(names)
            elif node.module and node.module.split(".")[0] == "oprag_server":
                out.append(tuple(node.module.split(".")[1:]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "oprag_server":
                    out.append(tuple(a.name.split(".")[1:]))
    return out


def test_no_server_module_imports_from_a_layer_above() -> None:
    bad = []
    for path in sorted(SERVER.rglob("*.py")):
        rel = path.relative_to(SERVER).with_suffix("").parts
        package = rel[:-1]
        mine = _layer(rel)
        for target in _imports(path, package):
            theirs = _layer(target)
            if theirs > mine:
                bad.append(f"{'/'.join(rel)} (layer {mine}) imports {'.'.join(target)} (layer {theirs})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("from ..engine.query import QueryEngine\nfrom oprag_server.service import metrics\n")
    targets = _imports(f, ("index",))
    assert [_layer(t) for t in targets] == [4, 5]


def test_client_imports_nothing_from_the_server() -> None:
    bad = []
    for path in sorted(CLIENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "oprag_server"]
    assert not bad, "client imports the server:\n" + "\n".join(bad)


def test_no_server_module_over_400_lines() -> None:
    long = {str(p.relative_to(SERVER)): n for p in SERVER.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"
