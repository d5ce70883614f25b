"""Findings of trial17 (a new user probing ANN indexes, odd inputs and error messages)."""

from __future__ import annotations

import pytest

from oprag_server import cli
from oprag_server.config import DenseConfig


@pytest.mark.parametrize("m", [0, 1, 513, 100_000])
def test_hnsw_m_out_of_range_is_refused_at_start(m, capsys):
    """--hnsw-m 1 used to start, and the first ingest crashed the shard process (FAISS divides by
    ln(M) = 0: SIGSEGV), the ingest failing UNAVAILABLE; 100,000 started too (800 KB of links
    per vector). Both are start-up errors now, exit status 2, naming the range."""
    with pytest.raises(ValueError, match=r"hnsw_m must be in \[2, 512\], got "):
        DenseConfig(kind="hnsw", hnsw_m=m)
    assert cli.main(["--dense-index", "hnsw", "--hnsw-m", str(m)]) == 2
    assert f"--hnsw-m must be in [2, 512], got {m}" in capsys.readouterr().err


def test_hnsw_m_bounds_are_usable():
    assert DenseConfig(kind="hnsw", hnsw_m=2).hnsw_m == 2
    assert DenseConfig(kind="hnsw", hnsw_m=512).hnsw_m == 512


def test_parquet_metadata_that_is_not_json_says_what_the_column_must_hold(tmp_path):
    """Said only "row 0: Expecting value: line 1 column 1 (char 0)"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from oprag_client.loaders import LOADERS

    f = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["t"], "metadata": ["lang=en"]}), f)
    with pytest.raises(ValueError) as ei:
        list(LOADERS["parquet"]([f]))
    msg = str(ei.value)
    assert msg.startswith(f"{f}: row 0: metadata is not JSON (Expecting value at character 0 of 'lang=en')"), msg
    assert "must hold a JSON object" in msg


def test_a_binary_text_column_says_to_write_strings(tmp_path):
    """Said "row 0: text must be a string, got bytes" (bytes that need not even be UTF-8)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from oprag_client.loaders import LOADERS

    f = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": pa.array([b"caf\xe9"], pa.binary())}), f)
    with pytest.raises(ValueError) as ei:
        list(LOADERS["parquet"]([f]))
    assert str(ei.value).startswith(f"{f}: row 0: text is bytes (a binary column): write the text column as UTF-8"), str(ei.value)


def test_client_help_gives_the_defaults():
    """`oprag ingest --help` and `oprag query --help` named no default for --format (text),
    --docs-per-stream (256), --mode (hybrid) or --timeout, and left --no-progress, --json and the
    positional arguments unexplained."""
    from oprag_client import cli as ccli

    parser = ccli._parser({})
    sub = next(a for a in parser._actions if a.dest == "cmd").choices
    ingest = " ".join(sub["ingest"].format_help().split())
    query = " ".join(sub["query"].format_help().split())
    for words in ("input format (default: text", "(default: 256)", "--no-progress no progress bar",
                  "paths files or folders to read", "default: none, 5 for health"):
        assert words in ingest, words
    for words in ("(default: hybrid", "--json print the reply as one JSON object", "question the question"):
        assert words in query, words


def test_a_qrels_score_that_is_not_a_number_names_file_and_line(tmp_path):
    """`oprag eval beir` said "cannot read queries/qrels: could not convert string to float: 'abc'"."""
    from oprag_client.evaluate import load_qrels

    f = tmp_path / "q.tsv"
    f.write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n2\td2\tabc\n")
    with pytest.raises(ValueError) as ei:
        load_qrels(f)
    assert str(ei.value).startswith(f"{f}:3: score 'abc' is not a number"), str(ei.value)
    f.write_text("1\td1\t1\n2\td2\tx\n")  # no header line
    with pytest.raises(ValueError, match=f"{f}:2: score 'x' is not a number"):
        load_qrels(f)


@pytest.mark.parametrize("vector", ['"0.1 0.2"', "{\"a\": 1}", "3"])
def test_a_jsonl_vector_that_is_not_a_list_names_file_and_line(tmp_path, vector):
    """Said "document 'j7': vector is a str: ..." only when the stream was sent, naming no line."""
    from oprag_client.loaders import load_jsonl

    f = tmp_path / "v.jsonl"
    f.write_text('{"id": "ok", "text": "fine"}\n{"id": "j7", "text": "x", "vector": ' + vector + "}\n")
    with pytest.raises(ValueError) as ei:
        list(load_jsonl([f]))
    assert str(ei.value).startswith(f"{f}:2: vector must be a list of numbers, got "), str(ei.value)


@pytest.mark.parametrize("ef", [0, 65537, 100_000])
def test_ef_construction_out_of_range_is_refused_at_start(ef, capsys):
    """trial58 #3: --ef-construction 100000 started (the request's ef_search is capped at 65536, this had no cap)."""
    with pytest.raises(ValueError, match=r"ef_construction must be in \[1, 65536\], got "):
        DenseConfig(kind="hnsw", ef_construction=ef)
    assert cli.main(["--dense-index", "hnsw", "--ef-construction", str(ef)]) == 2
    assert f"--ef-construction must be in [1, 65536], got {ef}" in capsys.readouterr().err
