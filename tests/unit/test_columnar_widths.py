"""Vectors of two widths across the files of one columnar ingest (trial50 #6): a folder whose second Parquet file held
width 100 beside 384 failed its stream on the server, by a message naming a document of the stream, not the file. Now
the loader refuses the file by name before its first row (Parquet and Arrow; list and fixed-size list columns; one
row per document and chunk rows), while files of one width still load."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from oprag_client.loaders import load_arrow, load_parquet


def _table(prefix: str, n: int, width: int, fixed: bool, chunk_rows: bool) -> pa.Table:
    v = np.random.default_rng(width).standard_normal((n, width)).astype(np.float32)
    col = (pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), width) if fixed
           else pa.array([r.tolist() for r in v], type=pa.list_(pa.float32())))
    ids = [f"{prefix}{i // 2 if chunk_rows else i}" for i in range(n)]
    return pa.table({"doc_id" if chunk_rows else "id": ids, "text": [f"t{i}" for i in range(n)], "vector": col})


def _write(path, table, kind):
    if kind == "parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(path, table.schema) as w:
            w.write_table(table)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("chunk_rows", [False, True])
def test_a_file_of_another_width_is_refused_by_name_before_its_rows(tmp_path, kind, fixed, chunk_rows):
    ext, load = (".parquet", load_parquet) if kind == "parquet" else (".arrow", load_arrow)
    d = tmp_path / "dir"
    d.mkdir()
    _write(d / f"a{ext}", _table("a", 4, 8, fixed, chunk_rows), kind)
    _write(d / f"b{ext}", _table("b", 4, 5, fixed, chunk_rows), kind)
    _write(d / f"c{ext}", _table("c", 4, 8, fixed, chunk_rows), kind)
    got = []
    with pytest.raises(ValueError) as e:
        for doc in load([d]):
            got.append(doc.id)
    assert str(e.value).startswith(f"{d / f'b{ext}'}: column 'vector' holds vectors of width 5, but {d / f'a{ext}'} "
                                   "holds width 8"), str(e.value)
    assert got and all(x.startswith("a") for x in got)  # a's rows only: none of b's was yielded
    (d / f"b{ext}").unlink()
    docs = list(load([d]))  # one width: every file loads
    assert {x.id[0] for x in docs} == {"a", "c"} and len(docs) == (4 if chunk_rows else 8)
