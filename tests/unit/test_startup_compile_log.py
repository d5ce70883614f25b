"""The first start compiles the search kernels for a minute or two (numba; cached afterwards): the
server says so before it starts, with an estimate, and after, with the time taken
(startup.warm_beside, startup.uncached_kernels). No server: a stand-in package tree and models."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import subprocess
import sys
import time

import pytest

from oprag_server import startup


def _tree(tmp_path):
    pkg = tmp_path / "pkg"
    for rel in ("index/kernels.py", "index/kernels_scan.py", "index/term_ids.py", "operators/union.py", "index/dense.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("# numba kernels\n")
        os.utime(pkg / rel, (1000, 1000))
    return pkg


def _nbi(d, stem, mtime):
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{stem}.fn-12.py311.nbi"
    f.write_bytes(b"")
    os.utime(f, (mtime, mtime))


def test_uncached_kernels_finds_the_modules_numba_has_not_compiled(tmp_path):
    pkg, env = _tree(tmp_path), {"XDG_CACHE_HOME": str(tmp_path / "nocache")}
    cold, total = startup.uncached_kernels(pkg, env)
    assert total == 4 and sorted(p.name for p in cold) == ["kernels.py", "kernels_scan.py", "term_ids.py", "union.py"]
    _nbi(pkg / "index" / "__pycache__", "kernels", 2000)  # in-tree cache, newer than the source
    _nbi(pkg / "index" / "__pycache__", "kernels_scan", 500)  # older than the source: stale
    _nbi(pkg / "operators" / "__pycache__", "term_ids", 2000)  # another module's folder
    user = tmp_path / "numba-cache"  # NUMBA_CACHE_DIR: under <folder>_<sha1 of its absolute path>
    _nbi(user / _subpath(pkg / "index"), "term_ids", 2000)
    cold, _ = startup.uncached_kernels(pkg, env)
    assert sorted(p.name for p in cold) == ["kernels_scan.py", "term_ids.py", "union.py"]
    cold, _ = startup.uncached_kernels(pkg, {**env, "NUMBA_CACHE_DIR": str(user)})  # numba then looks only there
    assert sorted(p.name for p in cold) == ["kernels.py", "kernels_scan.py", "union.py"]
    _nbi(tmp_path / "nocache" / "numba" / _subpath(pkg / "operators"), "union", 2000)
    cold, _ = startup.uncached_kernels(pkg, env)  # the user-wide cache (a read-only install)
    assert sorted(p.name for p in cold) == ["kernels_scan.py", "term_ids.py"]


def test_a_kernel_source_newer_than_a_cache_makes_it_stale_and_drop_deletes_it(tmp_path):
    """numba checks a cached function against its own file only: a change to kernels.py must also
    retire the caches of the modules that call into it (kernels_carry's carry_band kept the old
    kernels.skyband compiled in). Every module cached before the newest kernel source is cold, and
    ``drop`` deletes its index and data files (and nothing else)."""
    pkg, env = _tree(tmp_path), {"XDG_CACHE_HOME": str(tmp_path / "nocache")}
    cache = pkg / "index" / "__pycache__"
    for stem in ("kernels", "kernels_scan", "term_ids"):
        _nbi(cache, stem, 2000)
        (cache / f"{stem}.fn-12.py311.1.nbc").write_bytes(b"x")
    _nbi(pkg / "operators" / "__pycache__", "union", 2000)
    (cache / "other.fn-3.py311.nbi").write_bytes(b"")
    assert startup.uncached_kernels(pkg, env)[0] == []
    os.utime(pkg / "index" / "kernels.py", (3000, 3000))  # kernels.py edited after every cache was written
    cold, _ = startup.uncached_kernels(pkg, env, drop=True)
    assert sorted(p.name for p in cold) == ["kernels.py", "kernels_scan.py", "term_ids.py", "union.py"]
    assert sorted(f.name for f in cache.iterdir()) == ["other.fn-3.py311.nbi"]
    assert not list((pkg / "operators" / "__pycache__").iterdir())


def test_a_changed_callee_in_another_module_is_compiled_again(tmp_path):
    """Against numba itself: kernels_b.g (cached) calls kernels_a.f; after kernels_a.py changes,
    numba alone would load g with the old f compiled in; after ``uncached_kernels(drop=True)`` (what
    a start and ``precompile`` do) g gives the new f's result."""
    pkg = tmp_path / "pkg"
    (pkg / "index").mkdir(parents=True)
    a, b = pkg / "index" / "kernels_a.py", pkg / "index" / "kernels_b.py"
    a.write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    b.write_text("from numba import njit\nfrom kernels_a import f\n\n@njit(cache=True)\ndef g(x):\n    return f(x) * 10\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")

    def g(x):
        out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import kernels_b; "
                              "print(kernels_b.g(int(sys.argv[2])))", str(pkg / "index"), str(x)],
                             env=env, check=True, timeout=120, capture_output=True, text=True)
        return int(out.stdout.split()[-1])

    assert g(1) == 20
    for f in [a, b, *(pkg / "index" / "__pycache__").iterdir()]:  # all of it written a minute ago
        t = f.stat().st_mtime - 60
        os.utime(f, (t, t))
    a.write_text(a.read_text().replace("x + 1", "x + 2"))  # (now: newer than every cache file)
    assert [p.name for p in startup.uncached_kernels(pkg, env)[0]] == ["kernels_a.py", "kernels_b.py"]
    startup.uncached_kernels(pkg, env, drop=True)
    assert g(1) == 30  # (without the drop: 20, kernels_b's cache still holding the old f)
    assert startup.uncached_kernels(pkg, env) == ([], 2)


def _subpath(folder):
    """numba's folder for a source folder under a cache root (numba.core.caching)."""
    folder = os.path.abspath(folder)
    return f"{os.path.basename(folder)}_{hashlib.sha1(folder.encode()).hexdigest()}"


@pytest.mark.parametrize("where", ["NUMBA_CACHE_DIR", "in-tree"])
def test_a_module_numba_really_cached_counts_as_cached(tmp_path, where):
    """Against numba itself: a kernel module compiled once (cache=True) in a subprocess is not
    reported as cold afterwards. With NUMBA_CACHE_DIR set every start said 'compiling search
    kernels, first start only' (the check looked under the folder's absolute path, numba writes
    under <folder>_<sha1>)."""
    pkg = tmp_path / "pkg"
    (pkg / "index").mkdir(parents=True)
    (pkg / "index" / "term_ids.py").write_text(
        "from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if where == "NUMBA_CACHE_DIR":
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
    assert [p.name for p in startup.uncached_kernels(pkg, env)[0]] == ["term_ids.py"]
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import term_ids; term_ids.f(1)",
                    str(pkg / "index")], env=env, check=True, timeout=120)
    assert startup.uncached_kernels(pkg, env) == ([], 1)


def test_the_real_package_lists_its_kernel_modules():
    cold, total = startup.uncached_kernels()
    assert total >= 10 and len(cold) <= total


class _Model:
    def warm_up(self) -> None:
        time.sleep(0.05)


def _oprag(caplog) -> list[str]:
    """The messages of the ``oprag`` logger about the compile only (another test's leftover asyncio
    task may log 'Task was destroyed but it is pending!' here when it is garbage-collected; the
    models' and the shards' own start-up lines, fix23b, are not about it)."""
    return [r.getMessage() for r in caplog.records if r.name == "oprag" and "compil" in r.getMessage()]


def _start(caplog, cold: int, total: int = 4, fail: bool = False):
    seen = []

    def start():
        seen.append(_oprag(caplog))  # what was logged before the compile began
        time.sleep(0.2)
        if fail:
            raise RuntimeError("shard failed")

    async def main():  # as serve: preflight (which notes the compile), then the shard start beside the warm-up
        assert startup.note_compile() == bool(cold)
        loop = asyncio.get_running_loop()
        await startup.warm_beside(_Model(), None, loop.run_in_executor(None, start))

    with caplog.at_level(logging.INFO, logger="oprag"):
        try:
            asyncio.run(main())
        except RuntimeError:
            pass
    return seen[0], _oprag(caplog)


def test_a_cold_start_logs_a_line_before_the_compile_and_one_after_with_the_time(caplog, monkeypatch):
    monkeypatch.setattr(startup, "uncached_kernels", lambda **kw: ([object()] * 13, 13))
    before, lines = _start(caplog, 13)
    assert before == ["compiling search kernels, first start only, ~95 s (13 of 13 kernel modules not in numba's "
                      "cache; cached for the next start)"]
    (after,) = [ln for ln in lines if ln not in before]
    took = float(after.split(" in ")[1].split(" s ")[0])
    assert after.startswith("search kernels compiled and models warmed up in ") and 0.2 <= took < 5


@pytest.mark.parametrize("cold, want", [(0, None), (1, "~10 s"), (6, "~45 s")])
def test_a_cached_start_is_silent_and_a_partial_one_estimates_less(caplog, monkeypatch, cold, want):
    monkeypatch.setattr(startup, "uncached_kernels", lambda **kw: ([object()] * cold, 13))
    _, lines = _start(caplog, cold)
    if want is None:
        assert lines == []
    else:
        assert want in lines[0] and len(lines) == 2


def test_a_failed_start_logs_no_time(caplog, monkeypatch):
    monkeypatch.setattr(startup, "uncached_kernels", lambda **kw: ([object()] * 13, 13))
    _, lines = _start(caplog, 13, fail=True)
    assert len(lines) == 1 and lines[0].startswith("compiling search kernels")
