"""trial39 #5: every ``--json`` invocation prints one JSON object on stdout, also when it fails:
refused arguments (argparse's own checks and the client's), and a call that fails (here a port no
server listens on: a real gRPC channel). ``oprag ingest --json`` keeps its summary's keys."""

from __future__ import annotations

import json
import socket

import grpc
import pytest

from oprag_client import cli


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _one_object(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


@pytest.mark.parametrize("argv, code, status", [
    (["query", "--json", "--no-generate", "--top-k", "abc", "q"], "USAGE", 2),
    (["query", "--json", "--no-memory", "q"], "USAGE", 2),
    (["query", "--json", "--bogus", "q"], "USAGE", 2),
    (["query", "--json", "--no-generate", "q"], "UNAVAILABLE", 1),
    (["stats", "--json"], "UNAVAILABLE", 1),
    (["delete", "--json", "d1"], "UNAVAILABLE", 1),
])
def test_a_failing_json_command_prints_an_error_object(argv, code, status, capsys):
    try:
        got = cli.main([argv[0], "--server", _closed_port(), *argv[1:]])
    except SystemExit as exc:  # (argparse's own refusals exit)
        got = exc.code
    assert got == status
    obj = _one_object(capsys)
    assert obj["error"]["code"] == code and obj["error"]["message"], obj


def test_ingest_with_an_unknown_format_prints_the_summary_keys(tmp_path, capsys):
    f = tmp_path / "d.txt"
    f.write_text("hello")
    with pytest.raises(SystemExit) as ei:
        cli.main(["ingest", "--server", _closed_port(), "--json", "--format", "bogus", str(f)])
    assert ei.value.code == 2
    obj = _one_object(capsys)
    assert {"documents", "chunks", "seq", "streams", "chunks_per_s", "error"} <= set(obj)
    assert "--format" in obj["error"]["message"] and obj["error"]["stored"] is False


def test_query_json_has_sources_whatever_the_generation(capsys, monkeypatch):
    """``sources`` is in every ``oprag query --json`` object: None with --no-generate (as finish_reason)."""
    from types import SimpleNamespace

    r = SimpleNamespace(hits=[], timings_ms={}, request_id="r", memory_context="", memory_used=False,
                        resolved_query="q", retrieval=SimpleNamespace(missing_shards=[], partial=False), finish_reason="", sources=[])

    class _C:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def retrieve(self, q, **kw):
            return r

    monkeypatch.setattr(cli, "_client", lambda a: _C())
    monkeypatch.setattr(cli, "_retrieval_json", lambda r: {})
    assert cli.main(["query", "--json", "--no-generate", "q"]) == 0
    obj = _one_object(capsys)
    assert "sources" in obj and obj["sources"] is None and obj["finish_reason"] is None


# -- trial51 #1: Ctrl-C (SIGINT) ends every client command as `oprag ingest` does: no traceback, exit status 130,
# `oprag: interrupted (Ctrl-C)` on stderr, and with --json one object on stdout with code CANCELLED

class _Interrupted:
    """A client whose every call is cut short by Ctrl-C (KeyboardInterrupt raised where the call blocks)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        def call(*args, **kw):
            raise KeyboardInterrupt
        return call


def _run_interrupted(argv) -> int:
    try:
        return cli.main(argv)
    except KeyboardInterrupt:  # (pytest would stop the whole session on it)
        pytest.fail(f"oprag {' '.join(argv)}: KeyboardInterrupt escaped (a traceback)")


@pytest.mark.parametrize("argv", [
    ["query", "q"], ["query", "--no-generate", "q"], ["stats"], ["delete", "d1"], ["clear-session", "s"], ["health"],
])
@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_ends_a_command_with_status_130_and_one_message(argv, as_json, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_client", lambda a, **kw: _Interrupted())
    got = _run_interrupted([argv[0], *(["--json"] if as_json else []), *argv[1:]])
    out, err = capsys.readouterr()
    assert got == 130
    assert err == "oprag: interrupted (Ctrl-C)\n", err
    if as_json:
        assert json.loads(out) == {"error": {"code": "CANCELLED", "message": "interrupted (Ctrl-C)"}}
    else:
        assert out == ""


def test_ctrl_c_during_eval_ends_it_at_once(tmp_path, monkeypatch, capsys):
    """``oprag eval beir`` runs its queries on a thread pool, which joined its threads before the channel closed: a
    query in flight on a server that does not answer (closing the channel cancels it) held Ctrl-C up until then."""
    import signal
    import threading
    import time
    from types import SimpleNamespace

    from oprag_client import cli_eval

    n = 40
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"w{i}"}) + "\n" for i in range(n)))
    (tmp_path / "qrels.tsv").write_text("".join(f"q{i}\td{i}\t1\n" for i in range(n)))
    closed, calls = threading.Event(), []

    class _Hanging:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            closed.set()
            return False

        def retrieve(self, *args, **kw):
            calls.append(1)
            closed.wait(10)  # (a call in flight until the channel closes)
            return SimpleNamespace(documents=[])

    monkeypatch.setattr(cli_eval, "_client", lambda a: _Hanging())
    # (Ctrl-C's default handler, as in a shell: a test module run before this one in the same pytest worker may have
    # left SIGINT ignored, as a shard worker's loop run in process sets it, and the signal was then lost: 200 s, exit 0)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    t0 = time.perf_counter()
    timer.start()
    try:
        got = _run_interrupted(["eval", "beir", "--queries", str(tmp_path / "q.jsonl"), "--qrels",
                                str(tmp_path / "qrels.tsv"), "--concurrency", "2"])
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
    took = time.perf_counter() - t0
    assert got == 130 and took < 5.0, (got, took)
    assert capsys.readouterr().err == "oprag: interrupted (Ctrl-C)\n"
    assert len(calls) == 2  # (the queued queries were not started)


def test_sigint_on_a_blocked_query_json_prints_the_error_object_not_a_traceback():
    """The trial's case end to end: ``oprag query --json ...`` waiting on a server that never answers (a socket
    that accepts and says nothing), then SIGINT: was 32 lines of traceback and nothing on stdout."""
    import signal
    import subprocess
    import time

    from oprag_client.testing import oprag_cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        target = f"127.0.0.1:{s.getsockname()[1]}"
        p = subprocess.Popen([*oprag_cli(), "query", "--json", "--server", target, "--max-new-tokens", "200",
                              "lobster"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        conn = None
        try:
            s.settimeout(30)
            conn, _ = s.accept()  # the client connected: its call is under way
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
            if conn is not None:
                conn.close()
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err and err.strip() == "oprag: interrupted (Ctrl-C)", err
    assert json.loads(out) == {"error": {"code": "CANCELLED", "message": "interrupted (Ctrl-C)"}}


# -- trial51 #2: ingest's argument errors are USAGE (exit status 2) as every other command's; an input that could
# not be read stays null

@pytest.mark.parametrize("argv", [
    ["--docs-per-stream", "0", "{f}"],
    ["--format", "foo", "{f}"],
    ["--bogus", "{f}"],
    ["{d}/nonexistent"],  # (README: "an input refused before anything is sent (a missing path, a wrong --format)")
    ["--vector-column", "v", "{f}"],
    ["--format", "jsonl", "{d}"],
    ["{d}/x.jsonl"],
])
def test_ingest_argument_errors_are_usage_with_status_2(argv, tmp_path, capsys):
    f = tmp_path / "d.txt"
    f.write_text("hello")
    (tmp_path / "x.jsonl").write_text('{"id": "a", "text": "b"}\n')
    args = ["ingest", "--server", _closed_port(), "--json", "--no-progress",
            *[x.format(f=f, d=tmp_path) for x in argv]]
    try:
        got = cli.main(args)
    except SystemExit as exc:
        got = exc.code
    assert got == 2
    obj = _one_object(capsys)
    assert obj["error"]["code"] == "USAGE" and obj["error"]["stream"] == 0 and obj["error"]["stored"] is False, obj
    assert obj["documents"] == 0 and obj["streams"] == []


def test_ingest_of_an_input_that_cannot_be_read_keeps_code_null(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text("{broken\n")
    assert cli.main(["ingest", "--server", _closed_port(), "--json", "--no-progress", "--format", "jsonl", str(f)]) == 1
    assert _one_object(capsys)["error"]["code"] is None


# -- trial51 #4: oprag health --service NAME --json

class _Health:
    def __init__(self, statuses):
        self.statuses, self.asked = statuses, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def health(self, service="", *, timeout=None):
        self.asked.append(service)
        if service not in self.statuses:
            raise _NotFound()
        return self.statuses[service]


class _NotFound(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND

    def details(self):
        return ""


@pytest.mark.parametrize("service, status, rc", [("", "SERVING", 0), ("oprag.v1.OpRAG.Ingest", "NOT_SERVING", 1)])
def test_health_json_names_the_service_and_its_status(service, status, rc, monkeypatch, capsys):
    stub = _Health({"": "SERVING", "oprag.v1.OpRAG.Ingest": "NOT_SERVING"})
    monkeypatch.setattr(cli, "_client", lambda a, **kw: stub)
    argv = ["health", "--json"] + (["--service", service] if service else [])
    assert cli.main(argv) == rc
    assert _one_object(capsys) == {"service": service, "status": status}
    assert cli.main(argv[:1] + argv[2:]) == rc
    assert capsys.readouterr().out == f"{status}\n"
    assert stub.asked == [service, service]


def test_health_of_an_unknown_service_names_the_known_ones(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_client", lambda a, **kw: _Health({"": "SERVING"}))
    assert cli.main(["health", "--json", "--service", "nosuch"]) == 1
    out, err = capsys.readouterr()
    obj = json.loads(out)
    assert obj["error"]["code"] == "NOT_FOUND" and "'nosuch'" in obj["error"]["message"], obj
    assert "oprag.v1.OpRAG.Ingest" in obj["error"]["message"] and "oprag.v1.OpRAG.Ingest" in err


def test_health_json_on_a_server_that_is_not_there_prints_the_error_object(capsys):
    assert cli.main(["health", "--json", "--server", _closed_port(), "--timeout", "5"]) == 1
    assert _one_object(capsys)["error"]["code"] == "UNAVAILABLE"


# -- trial51b F1: Ctrl-C while the command is still starting (the interpreter importing grpc, numpy, the client: 0.3-3 s
# on a loaded machine) was a traceback ending in KeyboardInterrupt, death by SIGINT, and nothing on stdout with --json:
# the console script's entry point (oprag_client.cli_entry) is reached before those imports. The child's grpc import is
# held up here (a sitecustomize on its PYTHONPATH) until the test's SIGINT comes.

_SLOW_GRPC = '''
import os, sys, time

class _SlowGrpc:
    done = False

    def find_spec(self, name, path=None, target=None):
        if name != "grpc" or self.done:
            return None
        self.done = True
        open(os.environ["OPRAG_TEST_MARK"], "w").close()
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            if os.environ.get("OPRAG_TEST_IMPORT_ERROR"):  # (as grpc's Cython module once said it, trial51b)
                raise ImportError("Failed to import 'zlib.decompress' - cannot initialise module strings") from None
            raise
        return None

sys.meta_path.insert(0, _SlowGrpc())
'''


def _sigint_while_importing_grpc(argv, tmp_path, import_error=False):
    """``oprag argv`` (the console script), SIGINT while it imports grpc: (exit status, stdout, stderr)."""
    import os
    import signal
    import subprocess
    import time

    from oprag_client.testing import oprag_cli

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SLOW_GRPC)
    mark = tmp_path / "importing-grpc"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OPRAG_TEST_MARK": str(mark), "OPRAG_TEST_IMPORT_ERROR": "1" if import_error else ""}
    p = subprocess.Popen([*oprag_cli(), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        end = time.monotonic() + 60
        while not mark.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        assert mark.exists(), p.communicate(timeout=30)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    return p.returncode, out, err


@pytest.mark.parametrize("argv, import_error", [
    (["stats", "--json", "--server", "127.0.0.1:1"], False),
    (["query", "--json", "lobster"], True),  # (the ImportError an interrupted import once raised: was exit status 1)
])
def test_ctrl_c_while_the_command_starts_is_the_interrupt(argv, import_error, tmp_path):
    rc, out, err = _sigint_while_importing_grpc(argv, tmp_path, import_error)
    assert rc == 130, (rc, out, err)
    assert err == "oprag: interrupted (Ctrl-C)\n", err  # (no traceback)
    assert json.loads(out) == {"error": {"code": "CANCELLED", "message": "interrupted (Ctrl-C)"}}


def test_ctrl_c_while_ingest_starts_prints_its_summary(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("hello")
    rc, out, err = _sigint_while_importing_grpc(["ingest", "--json", "--no-progress", str(f)], tmp_path)
    assert rc == 130 and err == "oprag: interrupted (Ctrl-C)\n", (rc, out, err)
    obj = json.loads(out)
    assert {"documents", "chunks", "seq", "streams", "chunks_per_s"} <= set(obj) and obj["streams"] == []
    assert obj["error"] == {"stream": 0, "first_index": 0, "code": "CANCELLED", "message": "interrupted (Ctrl-C)",
                            "stored": False}  # (nothing was sent)


def test_ctrl_c_while_starting_without_json_prints_nothing_on_stdout(tmp_path):
    rc, out, err = _sigint_while_importing_grpc(["health"], tmp_path)
    assert (rc, out, err) == (130, "", "oprag: interrupted (Ctrl-C)\n")


# -- trial51b F2: a Ctrl-C once the command has its result changes neither its output nor its exit status (a SIGINT as
# `oprag stats --json` exited after printing UNAVAILABLE killed it: $? said 130, the output UNAVAILABLE)

@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_ctrl_c_after_the_result_keeps_the_exit_status(delay):
    import signal
    import subprocess
    import time

    from oprag_client.testing import oprag_cli

    p = subprocess.Popen([*oprag_cli(), "stats", "--json", "--server", _closed_port()], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()  # (the command's object: the interpreter then shuts grpc down, ~0.3 s)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 1, (p.returncode, first, out, err)
    assert out == "" and json.loads(first)["error"]["code"] == "UNAVAILABLE", (first, out)
    assert "interrupted" not in err and "Traceback" not in err and err.startswith("oprag: UNAVAILABLE"), err


@pytest.fixture()
def entry():
    """:func:`oprag_client.cli_entry.main` in this process, SIGINT's handler restored after it (it ignores SIGINT once
    the command returned, for the interpreter's exit)."""
    import signal

    from oprag_client import cli_entry

    before = signal.getsignal(signal.SIGINT)
    yield cli_entry.main
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_as_a_command_prints_its_result_adds_no_object(entry, monkeypatch, capsys):
    """The window inside the command: its object printed, a Ctrl-C before it returned (was a second, CANCELLED object
    and exit status 130)."""
    import signal

    def stats(a):
        print(json.dumps({"error": {"code": "UNAVAILABLE", "message": "m"}}))
        signal.raise_signal(signal.SIGINT)
        return 1

    monkeypatch.setitem(cli.COMMANDS, "stats", stats)
    assert entry(["stats", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"code": "UNAVAILABLE", "message": "m"}} and err == ""


def test_ctrl_c_during_a_call_under_the_entry_point(entry, monkeypatch, capsys):
    """Under the console script's handler a Ctrl-C during the call is reported as before (one object, 130)."""
    import signal

    def stats(a):
        signal.raise_signal(signal.SIGINT)
        raise AssertionError("not interrupted")

    monkeypatch.setitem(cli.COMMANDS, "stats", stats)
    assert entry(["stats", "--json"]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"code": "CANCELLED", "message": "interrupted (Ctrl-C)"}}
    assert err == "oprag: interrupted (Ctrl-C)\n"


def test_a_plugin_command_runs_with_pythons_own_sigint_handler(entry, monkeypatch):
    """``oprag serve`` handles its signals itself (asyncio.run installs its Ctrl-C handling only over Python's own
    handler): the entry point's handler is not the one it finds."""
    import signal
    from types import SimpleNamespace

    seen = []

    def serve(argv):
        seen.append(signal.getsignal(signal.SIGINT))
        return 0

    monkeypatch.setattr(cli, "_plugins", lambda: {"serve": SimpleNamespace(load=lambda: serve)})
    assert entry(["serve", "--port", "1"]) == 0
    assert seen == [signal.default_int_handler]
