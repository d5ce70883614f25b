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


def test_a_different_import_time_environment_or_command_is_not_forked() -> None:
    env = dict(os.environ)
    assert server_zygote.launcher(["python", "-c", "pass"], env, None) is None
    env["OMP_NUM_THREADS"] = str(int(env.get("OMP_NUM_THREADS", "1")) + 7)
    assert server_zygote.launcher(_argv("--help"), env, None) is None


def test_a_forked_server_exits_and_prints_as_a_subprocess_does(tmp_path) -> None:
    env = dict(os.environ)
    for args in (("--no-such-option",), ("--help",)):
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
