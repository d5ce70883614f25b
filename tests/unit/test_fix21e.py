"""New-user trial 21 (branch fix21e): own vectors in JSON lines (a boolean element was stored as
1.0, an empty ``chunks`` list said "expected ... id and text ('text')", a chunk without text
printed its vector, a finite 1e39 was reported as "NaN or infinity"), ``oprag eval beir --top-k``
above the server's 100, validation messages that did not say 0 means the default, and README
gaps (memory retention numbers, the 512-byte id, metrics missing from or mislabelled in the
table). The served paths (server messages, HTTP) are in tests/integration/test_fix21e_server.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from oprag_client import cli
from oprag_client.client import Doc
from oprag_client.loaders import load_jsonl, load_parquet
from oprag_client.vectors import floats, pack

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
D = 384


def _load(tmp_path, obj) -> list:
    p = tmp_path / "d.jsonl"
    p.write_text('{"id": "ok", "text": "fine"}\n' + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    return list(load_jsonl([p]))


@pytest.mark.parametrize("vector, words", [
    ([True] * D, "vector[0] is true, not a number"),  # was stored as 1.0 each (rc 0)
    ([0.5] * 3 + [False], "vector[3] is false, not a number"),
    ([0.1, "0.2"], 'vector[1] is the string "0.2", not a number: write numbers without quotes'),
    ([0.1, None], "vector[1] is null, not a number"),
    ([0.1, [0.2]], "vector[1] is a JSON array, not a number"),
    ([1e39] * D, "vector[0] is 1e+39, which overflows float32 (the largest magnitude is about 3.4e38)"),
    ([0.1, -3.5e38], "vector[1] is -3.5e+38, which overflows float32"),
    ([0.1, 10**400], "vector[1] is an integer of ~400 digits, which overflows float32"),  # no float holds it
])
def test_a_jsonl_vector_element_that_float32_cannot_carry_is_refused_naming_file_line_and_index(tmp_path, vector, words):
    with pytest.raises(ValueError) as ei:
        _load(tmp_path, {"id": "e7", "text": "a", "vector": vector})
    msg = str(ei.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}:2: ") and words in msg, msg
    assert "NaN or infinity" not in msg


def test_jsonl_nan_and_infinity_elements_are_named(tmp_path):
    for tok, shown in (("NaN", "NaN"), ("-Infinity", "-Infinity")):
        with pytest.raises(ValueError, match=rf":2: vector\[1\] is {shown}: vector elements must be finite"):
            _load(tmp_path, '{"id": "e3", "text": "a", "vector": [0.1, %s]}' % tok)


def test_the_largest_float32_values_and_integers_are_accepted(tmp_path):
    v = [3.4e38, -3.4028234663852886e38, 0, 7] + [0.5] * 4
    docs = _load(tmp_path, {"id": "big", "text": "a", "vector": v})
    assert docs[1].vector == v and docs[1].to_pb().vector[0] == np.float32(3.4e38)


@pytest.mark.parametrize("chunks, words, absent", [
    ([], 'chunks is empty: give at least one {"text": "...", "vector": [numbers]} object', "('text')"),
    ([{"vector": [0.123456789] * D}], 'chunks[0] has no "text" (its keys: "vector")', "0.123456789"),
    ([{"text": "a", "vector": [0.5] * D}, {"text": "b"}], 'chunks[1] has no "vector" (its keys: "text")', "0.5"),
    ([{"text": 5, "vector": [0.5] * D}], "chunks[0] text must be a string, got 5", "0.5"),
    ([{"text": "a", "vector": [0.5] * 3 + [True]}], "chunks[0] vector[3] is true, not a number", "0.5"),
    ([{"text": "a", "vector": [2e39] * D}], "chunks[0] vector[0] is 2e+39, which overflows float32", "NaN"),
])
def test_jsonl_chunk_messages_say_what_is_wrong_without_dumping_the_vector(tmp_path, chunks, words, absent):
    with pytest.raises(ValueError) as ei:
        _load(tmp_path, {"id": "c4", "chunks": chunks})
    msg = str(ei.value)
    assert ":2: " in msg and words in msg and absent not in msg, msg


def test_the_trial_repro_files_are_refused_with_their_reason():
    byo = Path("/work/wt/trial21-scripts/byo")
    if not byo.is_dir():
        pytest.skip("the trial's repro files are not on this machine")
    for name, words in (("bool_elem", "vector[0] is true"), ("chunks_empty", "chunks is empty"),
                        ("chunk_no_text", 'chunks[0] has no "text"'), ("huge_elem", "overflows float32"),
                        ("str_elem", "is the string")):
        with pytest.raises(ValueError, match=re.escape(words)):
            list(load_jsonl([byo / f"{name}.jsonl"]))


def test_oprag_ingest_refuses_a_boolean_vector_before_sending(tmp_path, capsys):
    """The trial's `oprag ingest --format jsonl` stored [true, ...] (rc 0); now the file and line
    are named before any stream starts (the server address here has no server)."""
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps({"id": "e7", "text": "a", "vector": [True] * D}) + "\n")
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--format", "jsonl", str(p)]) == 1
    err = capsys.readouterr().err
    assert f"{p}:1: vector[0] is true, not a number" in err and "UNAVAILABLE" not in err, err


def test_python_client_refuses_boolean_vectors():
    for v in ([True] * 4, [0.1, False], np.array([True, False])):
        with pytest.raises(ValueError, match="not a number|dtype bool"):
            floats(v, "document 'd': vector")
    with pytest.raises(ValueError, match="dtype bool"):
        pack(Doc("d", "t", vector=np.ones(4, dtype=bool)))
    assert floats([1, 0.5, np.float32(2)]) == [1, 0.5, np.float32(2)]  # ints and numpy floats stay numbers


def test_a_parquet_vector_column_of_booleans_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["t"], "vector": pa.array([[True] * 4], pa.list_(pa.bool_()))}), p)
    with pytest.raises(ValueError, match=r"column 'vector' must hold lists of numbers, got list<\w+: bool>"):
        list(load_parquet([p]))


def test_eval_top_k_above_the_server_limit_is_an_argparse_error(tmp_path, capsys):
    """--top-k 5000 passed argparse ("at least 100") and then failed every query with the
    server's INVALID_ARGUMENT "top_k must be in [1, 100]"."""
    (tmp_path / "q.jsonl").write_text('{"_id": "1", "text": "q"}\n')
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n1\td\t1\n")
    with pytest.raises(SystemExit) as ei:
        cli.main(["eval", "beir", "--top-k", "5000", "--queries", str(tmp_path / "q.jsonl"),
                  "--qrels", str(tmp_path / "qrels.tsv"), "--server", "127.0.0.1:1"])
    assert ei.value.code == 2
    err = capsys.readouterr().err  # (fix23a: one message for both sides of [10, 100])
    assert "--top-k: must be in [10, 100]" in err and "the server returns at most 100), got 5000" in err
    with pytest.raises(SystemExit):
        cli.main(["eval", "beir", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "at least 100" not in out and "10 to 100" in out


def _metrics_table() -> dict[str, str]:
    """{metric name: its README table row} of the ## Metrics table."""
    section = README.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `oprag_")]
    return {name: r for r in rows for name in re.findall(r"`(oprag_\w+)", r.split(" | ")[0])}


def test_the_readme_metrics_table_lists_exactly_the_exported_metrics_with_their_labels():
    """oprag_pruning_checks_skipped_total (and the widening counters) were exported but not in the
    table; oprag_overload_rejections_total's `queue` label was not listed."""
    from oprag_server.service.metrics import Metrics
    m = Metrics()
    exported = {c._name + ("_total" if c._type == "counter" else ""): c._labelnames
                for c in m.registry._collector_to_names}
    table = _metrics_table()
    assert set(table) == set(exported), (sorted(set(exported) - set(table)), sorted(set(table) - set(exported)))
    for name, labels in exported.items():
        missing = [lb for lb in labels if not re.search(rf"\b{lb}\b", table[name])]
        assert not missing, f"README metrics row of {name} does not name its label(s) {missing}: {table[name]}"
    assert "`query_latency`" in table["oprag_overload_rejections_total"]


def test_readme_gives_the_memory_retention_numbers_of_the_config_and_the_id_limit():
    from oprag_server.config import LimitsConfig, MemoryConfig
    mc, text = MemoryConfig(), " ".join(README.split())
    assert mc.max_turns_per_session == 32 and mc.ttl_s == 24 * 3600 and mc.max_records_total == 200_000
    assert "a session keeps its last 32 turns" in text and "idle for 24 h" in text
    assert "at most 200,000 memory records" in text and "(86,400 s; no turn recorded)" in text
    flags = text.split("Retention, per shard process (", 1)[1].split(")", 1)[0]
    assert flags == "`--memory-max-turns`, `--memory-ttl-s`, `--memory-max-records`"  # (trial52b: had none)
    rejected = text.split("Rejected documents (", 1)[1].split(") are listed", 1)[0]
    assert f"an id over {LimitsConfig().max_doc_id_bytes} bytes" in rejected
