"""The suite's server launcher (tests/server_zygote.py): a server forked from the zygote behaves
as ``python -m oprag_server`` started as a subprocess (exit status, output, signals), and a start
whose import-time environment differs is not forked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests import server_zygote


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "oprag_server", *args]


def test_a_start_is_forked_from_the_zygote_of_its_import_time_environment(tmp_path) -> None:
    env = dict(os.environ)
    assert server_zygote.launcher(["python", "-c", "pass"], env, None) is None
    other = {**env, "OMP_NUM_THREADS": str(int(env.get("OMP_NUM_THREADS", "1")) + 7)}
    zygotes = []
    for e in (env, other):
        forked = server_zygote.launcher(_argv("--help"), e, str(tmp_path))
        assert forked.wait(60) == 0
        z = server_zygote._zygotes[tuple(sorted(server_zygote._import_env(e).items()))]  # noqa: SLF001
        zygotes.append(z.proc.pid)
        assert z.proc.poll() is None
    assert zygotes[0] != zygotes[1]  # the other OMP_NUM_THREADS got a zygote of its own


def test_a_forked_server_exits_and_prints_as_a_subprocess_does(tmp_path) -> None:
    env = dict(os.environ)
    for args in (("--no-such-option",), ("--help",), ("--data-dir", str(tmp_path / "f"), "--shards", "0")):
        forked = server_zygote.launcher(_argv(*args), env, str(tmp_path))
        assert isinstance(forked, server_zygote.ForkedProcess)
        out_f, rc_f = forked.stdout.read(), forked.wait(60)
        ref = subprocess.run(_argv(*args), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=120)
        assert (rc_f, out_f) == (ref.returncode, ref.stdout)
        assert forked.poll() == rc_f


def test_a_signal_reaches_the_forked_server_in_its_own_session(tmp_path) -> None:
    forked = server_zygote.launcher(_argv("--data-dir", str(tmp_path / "d"), "--port", "0", "--metrics-port", "0",
                                          "--generator", "none"), dict(os.environ), str(tmp_path))
    assert os.getpgid(forked.pid) == forked.pid  # setsid: killpg takes its shard processes too
    os.killpg(forked.pid, signal.SIGKILL)
    assert forked.wait(60) == -signal.SIGKILL


def test_a_zygote_that_ends_removes_its_socket_and_directory(tmp_path) -> None:
    z = server_zygote.Zygote(dict(os.environ))
    d = os.path.dirname(z.path)
    assert os.path.exists(z.path)
    forked = z.fork(_argv("--help"), dict(os.environ), str(tmp_path))
    assert forked.wait(60) == 0  # the forked child's exit does not remove them
    assert os.path.exists(z.path)
    z.close()  # as when the test process ends: the zygote's stdin closes
    assert not os.path.exists(d)
