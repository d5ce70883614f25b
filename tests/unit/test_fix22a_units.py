"""Branch fix22a without a server: the session id rule (:mod:`oprag_server.service.session_ids`)
and the label combinations a fresh :class:`Metrics` exports as 0 (the real server's scrape:
tests/integration/test_fix22a.py)."""

from __future__ import annotations

import pytest

from oprag_server.config import LimitsConfig
from oprag_server.service import convert, session_ids
from oprag_server.service.convert import InvalidArgument
from oprag_server.service.http_labels import init_labels
from oprag_server.service.interceptors import StatusInterceptor
from oprag_server.service.metrics import Metrics


@pytest.mark.parametrize("sid", ["alice", "alice smith", "Ünïcødé-42", "x" * 256, "é" * 128, "a\u2028b"])
def test_allowed_session_ids(sid):
    assert session_ids.problem(sid, 256) is None
    assert convert.check_session_id(sid, LimitsConfig(), required=True) == sid


@pytest.mark.parametrize("sid, start", [
    ("\x00", "session_id contains the control character U+0000 at character 0"),
    ("ab\x1b[31m", "session_id contains the control character U+001B at character 2"),
    ("a\nb", "session_id contains the control character U+000A at character 1"),
    ("a\x9f", "session_id contains the control character U+009F at character 1"),
    ("\u00a0a", "session_id starts with whitespace"),
    ("a ", "session_id ends with whitespace"),
    ("\u2003", "session_id is only whitespace"),
    ("x" * 257, "session_id is longer than 256 bytes"),
    ("é" * 129, "session_id is longer than 256 bytes"),
])
def test_refused_session_ids_say_what_is_allowed(sid, start):
    with pytest.raises(InvalidArgument) as ei:
        convert.check_session_id(sid, LimitsConfig())
    assert str(ei.value) == f"{start}: {session_ids.rule(256)}"


def test_an_empty_session_id_is_no_session_unless_one_is_required():
    assert convert.check_session_id("", LimitsConfig()) == ""
    with pytest.raises(InvalidArgument, match=r"^session_id is empty: name the session to clear \(a session id is"):
        convert.check_session_id("", LimitsConfig(), required=True)


def _zero_series(m: Metrics) -> set[tuple]:
    return {(s.name, tuple(sorted(s.labels.items()))) for f in m.registry.collect() for s in f.samples
            if s.name.endswith("_total") and s.labels and s.value == 0}


def test_known_label_combinations_exist_before_any_use():
    m = Metrics()
    StatusInterceptor(m, "oprag.v1.OpRAG")
    got = _zero_series(m)
    assert ("oprag_requests_total", (("code", "OK"), ("method", "ClearSession"))) in got
    assert ("oprag_requests_total", (("code", "DEADLINE_EXCEEDED"), ("method", "Ingest"))) in got
    assert ("oprag_writes_after_caller_left_total", (("kind", "delete"), ("outcome", "applied"))) in got
    assert sum(n == "oprag_requests_total" for n, _ in got) == 7 * 7
    init_labels(m, tokens=True)  # the HTTP API's, with bearer tokens: UNAUTHENTICATED too
    got = _zero_series(m)
    assert ("oprag_requests_total", (("code", "UNAUTHENTICATED"), ("method", "HTTP /v1/retrieve"))) in got
    assert sum(n == "oprag_requests_total" for n, _ in got) == 7 * 7 + 5 * 8
    # an unknown service name exports nothing for it (and does not fail)
    StatusInterceptor(Metrics(), "no.such.Service")


# ------------------------------------------------------------------ start-up steps in the log
@pytest.mark.parametrize("was, now, lines", [
    ("flat", "hnsw", ["loading snapshot {snap}: 300 chunks",
                      "converting the dense index to hnsw: 300 rows (the snapshot's index is flat)",
                      "converted the dense index to hnsw: 300 rows in", "snapshot {snap} loaded: 300 chunks in"]),
    ("hnsw", "ivf", ["loading snapshot {snap}: 300 chunks",
                     "reading 300 vectors out of the snapshot's hnsw index (the dense index is now ivf)",
                     "read 300 vectors out of the snapshot's hnsw index in",
                     "converting the dense index to ivf: 300 rows (the snapshot's index is hnsw)",
                     "converted the dense index to ivf: 300 rows in", "snapshot {snap} loaded: 300 chunks in",
                     "IVF trained: 7 lists on 300 vectors in"]),  # (trial38 #6: "at start", not "the write ...")
    ("hnsw", "flat", ["loading snapshot {snap}: 300 chunks",
                      "reading 300 vectors out of the snapshot's hnsw index (the dense index is now flat)",
                      "read 300 vectors out of the snapshot's hnsw index in",
                      "the snapshot's hnsw search structure is not used: --dense-index flat scans every vector (the next snapshot drops it)",
                      "snapshot {snap} loaded: 300 chunks in"]),
    ("ivf", "flat", ["loading snapshot {snap}: 300 chunks",  # (trial38 #6: said nothing)
                     "the snapshot's ivf search structure is not used: --dense-index flat scans every vector (the next snapshot drops it)",
                     "snapshot {snap} loaded: 300 chunks in"]),
    ("hnsw", "hnsw", ["loading snapshot {snap}: 300 chunks", "snapshot {snap} loaded: 300 chunks in"]),
])
def test_a_shard_logs_its_snapshot_load_conversion_and_replay(tmp_path, capsys, was, now, lines):
    import pyarrow as pa
    from test_snapshot_beside import D, _batch

    from oprag_server.config import DenseConfig
    from oprag_server.shards.state import ShardState

    st = ShardState(0, D, tmp_path, dense=DenseConfig(kind=was, train_min=64))
    assert st.load(set()) == 0
    st.store.upsert(pa.Table.from_batches([_batch(0, 300)]), 1)
    st.snapshot()
    st.txns.wal.close()
    snap = (tmp_path / "shard-0" / "CURRENT").read_text().strip()
    capsys.readouterr()
    back = ShardState(0, D, tmp_path, dense=DenseConfig(kind=now, train_min=64))
    back.load(set())
    got = [ln.split(" shard 0: ", 1)[1] for ln in capsys.readouterr().err.splitlines()]
    assert len(got) == len(lines) and all(g.startswith(w.format(snap=snap)) for g, w in zip(got, lines)), got
    assert all(g.endswith(" s") for g in got[1::2] if " in " in g)
    assert all(g.endswith("vector re-added; at start, before serving)") for g in got if g.startswith("IVF trained"))
    assert len(back.store.dense.slots) == 300
