"""fix25 (a new user's trial): a qrels file that is not BEIR's tab-separated query-id, corpus-id,
score was skipped line by line (a space-separated file ended in "no judged query of the qrels is
in the queries file") or misread (TREC's ``Q0`` column taken for the doc id)."""

from __future__ import annotations

import pytest

from oprag_client import cli
from oprag_client.evaluate import load_qrels

TAIL = "a qrels line is query-id, corpus-id and an integer score, separated by tabs"


@pytest.mark.parametrize("text, line, words", [
    ("0 31715818 1\n", 1, "this line is separated by spaces: " + TAIL + ", not spaces"),
    ("query-id\tcorpus-id\tscore\n0\t31715818\t1\n1 2 1\n", 3, "this line is separated by spaces"),
    ("1\tQ0\t31715818\t1\n", 1, "this looks like TREC qrels (tab-separated query-id, Q0, doc-id, score): "
                                + TAIL + "; drop the Q0 column"),
    ("1 Q0 31715818 1\n", 1, "this looks like TREC qrels (space-separated"),
    ('{"query-id": "1", "corpus-id": "31715818", "score": 1}\n', 1, "this looks like JSON, not a qrels TSV"),
    ("1\td1\t1\t7\n", 1, "4 tab-separated fields, not 3: " + TAIL),
    ("1\td1\n", 1, "2 tab-separated fields, not 3: " + TAIL),
    ("31715818\n", 1, "1 tab-separated field, not 3: " + TAIL),
    ("1\td1\t1\n\n\t\td2\t1\n", 3, "4 tab-separated fields, not 3"),  # (line numbers count blank lines)
    ("1\t\t1\n", 1, "empty corpus-id: " + TAIL),
    (" \td1\t1\n", 1, "empty query-id: " + TAIL),
    ("1\td1\tinf\n", 1, "score 'inf' is not a finite number: " + TAIL),  # (was an OverflowError traceback)
])
def test_a_line_that_is_not_three_tab_separated_fields_names_file_and_line(tmp_path, text, line, words):
    f = tmp_path / "qrels.tsv"
    f.write_text(text)
    with pytest.raises(ValueError) as ei:
        load_qrels(f)
    assert str(ei.value).startswith(f"{f}:{line}: {words}"), str(ei.value)


def test_a_bad_score_names_its_own_line_without_a_header(tmp_path):
    """Without a header line the rows were all read first, so the message named the last line."""
    f = tmp_path / "q.tsv"
    f.write_text("1\td1\t1\n2\td2\tx\n3\td3\t1\n4\td4\t1\n")
    with pytest.raises(ValueError, match=f"^{f}:2: score 'x' is not a number"):
        load_qrels(f)


def test_beir_header_crlf_and_blank_lines_still_load(tmp_path):
    f = tmp_path / "train.tsv"
    f.write_bytes(b"query-id\tcorpus-id\tscore\r\n0\t31715818\t1\r\n\r\n2\t13734012\t1\r\n2\t99\t0\r\n")
    assert load_qrels(f) == {"0": {"31715818": 1}, "2": {"13734012": 1, "99": 0}}
    f.write_bytes(b"0\t31715818\t1\r\n1\td\t2.0\n")  # no header, mixed endings
    assert load_qrels(f) == {"0": {"31715818": 1}, "1": {"d": 2}}


def test_eval_exits_1_naming_the_line_as_for_a_bad_queries_line(tmp_path, capsys):
    """The same exit status and form as the other unreadable-input errors of `oprag eval beir`,
    before any call (no server listens at port 1)."""
    queries, qrels = tmp_path / "queries.jsonl", tmp_path / "qrels.tsv"
    queries.write_text('{"_id": "0", "text": "q"}\n')
    qrels.write_text("0 31715818 1\n")
    argv = ["eval", "beir", "--server", "127.0.0.1:1", "--queries", str(queries), "--qrels", str(qrels)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"oprag: --qrels: {qrels}:1: this line is separated by spaces"), err
    assert "no judged query" not in err
    queries.write_text('{"text": "q"}\n')
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.startswith(f"oprag: --queries: {queries}:1: ")


def test_a_fractional_score_is_an_error_naming_file_and_line(tmp_path, capsys):
    """trial26 #2: ``0\\t31715818\\t1.5`` was read as relevance 1, silently, though the README says
    the score is an integer and any other line is an error naming the file and line."""
    f = tmp_path / "q_float.tsv"
    f.write_text("query-id\tcorpus-id\tscore\n0\t31715818\t1\n0\t31715819\t1.5\n")
    with pytest.raises(ValueError) as ei:
        load_qrels(f)
    assert str(ei.value).startswith(f"{f}:3: score '1.5' is not an integer: {TAIL} (relevance grades"), str(ei.value)
    queries = tmp_path / "queries.jsonl"
    queries.write_text('{"_id": "0", "text": "q"}\n')
    assert cli.main(["eval", "beir", "--server", "127.0.0.1:1", "--queries", str(queries), "--qrels", str(f)]) == 1
    assert capsys.readouterr().err.startswith(f"oprag: --qrels: {f}:3: score '1.5' is not an integer")
