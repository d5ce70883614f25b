"""Empty vectors in columnar and JSON-lines input (trial21): a Parquet / Arrow row whose vector
list is empty, beside rows of 384 floats, was reported as "holds vectors of 2 widths (0, 384)",
naming no row; a JSON-lines ``vector: []`` named its file and line twice; an empty chunk vector
was refused at send time without its file and line."""

from __future__ import annotations

import re

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from oprag_client.loaders import load_arrow, load_jsonl, load_parquet  # noqa: E402

D = 384


def _table(vectors, chunk_rows=False):
    n = len(vectors)
    ids = {"doc_id": ["a"] * n} if chunk_rows else {"id": [f"d{i}" for i in range(n)]}
    return pa.table({**ids, "text": [f"text {i}" for i in range(n)],
                     "vector": pa.array(vectors, type=pa.list_(pa.float32()))})


def _parquet(tmp_path, vectors, chunk_rows=False):
    p = tmp_path / "v.parquet"
    pq.write_table(_table(vectors, chunk_rows), p)
    return p


def _arrow_batches(tmp_path, batches):
    """An Arrow IPC file of several record batches (row numbers count across them)."""
    p = tmp_path / "v.arrow"
    tables = [_table(b) for b in batches]
    with pa.ipc.new_file(p, tables[0].schema) as w:
        for t in tables:
            w.write_table(t)
    return p


def test_an_empty_vector_among_full_ones_names_its_row_not_two_widths(tmp_path):
    p = _parquet(tmp_path, [[0.1] * D, [0.1] * D, [], [0.1] * D])
    with pytest.raises(ValueError) as e:
        next(load_parquet([p]))
    msg = str(e.value)
    assert msg == (f"{p}: row 2: the vector is empty: give its numbers, or a null vector to have the server "
                   "embed the text"), msg
    assert "widths" not in msg


def test_several_empty_vectors_name_the_first_rows_across_batches_and_count_the_rest(tmp_path):
    full = [0.1] * D
    p = _arrow_batches(tmp_path, [[full, []], [full, [], None], [[]] * 6])
    with pytest.raises(ValueError, match=re.escape(f"{p}: rows 1, 3, 5, 6, 7 and 3 more: the vector is empty: "
                                                   "give their numbers")):
        next(load_arrow([p]))


def test_an_empty_chunk_row_vector_names_its_row(tmp_path):
    p = _parquet(tmp_path, [[0.1] * D, []], chunk_rows=True)
    with pytest.raises(ValueError, match=re.escape(f"{p}: row 1: the vector is empty: give its numbers "
                                                   "(chunk rows need a vector)")):
        next(load_parquet([p]))


def test_two_real_widths_name_the_first_row_of_each(tmp_path):
    p = _parquet(tmp_path, [[0.1] * D, None, [0.1] * 768, [0.1] * D])
    with pytest.raises(ValueError, match=re.escape(f"{p}: column 'vector' holds vectors of 2 widths "
                                                   f"({D} from row 0, 768 from row 2): one width per file")):
        next(load_parquet([p]))


@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "text": "t", "vector": [0.5, 0.5]}', '{"id": "b", "text": "t", "vector": []}'],
     "2: vector is empty: give its numbers, or leave it out to embed the text"),  # (named file:line twice)
    (['{"id": "a", "chunks": [{"text": "x", "vector": [0.5]}, {"text": "y", "vector": []}]}'],
     "1: chunks[1] vector is empty: give its numbers (a precomputed chunk needs its vector)"),  # (no file:line)
])
def test_an_empty_jsonl_vector_names_file_and_line_once(tmp_path, lines, message):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        list(load_jsonl([p]))
    assert str(e.value) == f"{p}:{message}"
