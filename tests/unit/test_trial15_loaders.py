"""Columnar input with a vector column (oprag ingest --format parquet|arrow), found by the
new-user trial of issue 15: a null element inside a vector read as NaN (the server then refused
the whole stream with "vectors_f32 contains NaN or infinity", naming no row or column), and an
empty vector read as "no vector", so the server embedded that row's text silently. Both are now
refused by the loader, naming the file and the row, before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from oprag_client.loaders import load_parquet  # noqa: E402


def _vec(seed: int) -> list[float]:
    return np.random.default_rng(seed).standard_normal(4).astype(np.float32).tolist()


def _write(tmp_path, vectors, typ=pa.list_(pa.float32())):
    p = tmp_path / "v.parquet"
    n = len(vectors)
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)], "text": [f"text {i}" for i in range(n)],
                             "vector": pa.array(vectors, type=typ)}), p)
    return p


def test_a_null_element_inside_a_vector_is_refused_naming_its_row(tmp_path):
    v = _vec(2)
    p = _write(tmp_path, [_vec(0), None, [v[0], None, v[2], v[3]]])  # row 1: embed it; row 2: a hole
    with pytest.raises(ValueError, match=r"v\.parquet: row 2: the vector holds a null"):
        list(load_parquet([p]))


def test_an_empty_vector_is_refused_not_sent_as_no_vector(tmp_path):
    p = _write(tmp_path, [None, []])
    with pytest.raises(ValueError, match=r"v\.parquet: row 1: the vector is empty"):
        list(load_parquet([p]))


def test_null_vectors_and_full_ones_still_load(tmp_path):
    rows = [_vec(0), None, _vec(1)]
    docs = list(load_parquet([_write(tmp_path, rows)]))
    assert [d.id for d in docs] == ["d0", "d1", "d2"] and docs[1].vector is None
    for d, want in ((docs[0], rows[0]), (docs[2], rows[2])):
        assert np.array_equal(np.asarray(d.vector, np.float32), np.asarray(want, np.float32))
    fixed = list(load_parquet([_write(tmp_path, rows, pa.list_(pa.float32(), 4))]))  # fixed-size, a null row
    assert fixed[1].vector is None and np.array_equal(np.asarray(fixed[2].vector), np.asarray(rows[2], np.float32))


def test_an_empty_jsonl_vector_is_refused_naming_file_and_line(tmp_path):
    from oprag_client.loaders import load_jsonl
    p = tmp_path / "d.jsonl"
    p.write_text('{"id": "a", "text": "t", "vector": [0.5, 0.5]}\n{"id": "b", "text": "t", "vector": []}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: vector is empty"):
        list(load_jsonl([p]))


def test_the_same_text_file_given_twice_is_read_once_not_refused(tmp_path):
    """``oprag ingest --format text notes/a.txt notes/a.txt`` (or ``notes notes``, or a folder and
    a file in it at its top) was refused: "notes/a.txt and notes/a.txt both get the document id"."""
    from oprag_client.loaders import load_text
    d = tmp_path / "notes"
    d.mkdir()
    (d / "a.txt").write_text("alpha")
    (d / "b.md").write_text("beta")
    assert [x.id for x in load_text([d / "a.txt", d / "a.txt"])] == ["a.txt"]
    assert [x.id for x in load_text([d, d])] == ["a.txt", "b.md"]
    assert [x.id for x in load_text([d, d / "a.txt"])] == ["a.txt", "b.md"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("another alpha")
    with pytest.raises(ValueError, match="both get the document id 'a.txt'"):
        list(load_text([d, other]))
