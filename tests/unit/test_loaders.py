"""Client-side loaders and evaluation metrics."""

from __future__ import annotations

import json
import math
import re

import pytest

from oprag_client.evaluate import doc_ranking, mrr_at_k, ndcg_at_k, recall_at_k
from oprag_client.loaders import load_jsonl, load_text, load_wikitext, wikitext_articles, wikitext_detok


def test_text_loader_skips_binary_and_non_utf8(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("héllo", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "c.md").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "d.bin").write_text("ignored suffix")
    docs = list(load_text([tmp_path]))
    assert [(d.id, d.text) for d in docs] == [("a.txt", "héllo")]
    err = capsys.readouterr().err
    assert "b.txt" in err and "c.md" in err


def test_wikitext_articles_split_and_detokenise():
    text = (" \n = Alpha = \n \n Alpha is a 3 @,@ 000 @-@ year @-@ old city . \n \n = = History = = \n \n Old . \n"
            " \n = Beta = \n \n Beta . \n")
    arts = list(wikitext_articles(text))
    assert [t for t, _ in arts] == ["Alpha", "Beta"]
    assert "3,000-year-old" in arts[0][1] and "= = History = =" in arts[0][1]


# WikiText-2/103 raw layout: " = Title = " between blank lines (" " lines), sections " = = S = = ",
# paragraphs one per line, sometimes with no blank line between them.
WIKI = (
    " \n = Homarus gammarus = \n \n"
    " Homarus gammarus is a lobster . \n \n"
    " = = Description = = \n \n"
    " The engine gives a thrust of \n"
    " = 1 <unk> / s and a nominal <unk> k = \n"
    " at sea level , 1 @,@ 200 @-@ odd trials . \n"
    " \n = M @-@ 82 ( Michigan highway ) = \n \n"
    " M @-@ 82 is a state trunkline highway . \n"
    " = 3 @.@ 5 x = \n"
    " \n = <unk> <unk> = \n \n First . \n"
    " \n = <unk> <unk> = \n \n Second . \n"
)


def test_wikitext_formula_lines_are_not_headings():
    arts = list(wikitext_articles(WIKI))
    assert [t for t, _ in arts] == ["Homarus gammarus", "M-82 ( Michigan highway )", "<unk> <unk>", "<unk> <unk>"]
    lobster = arts[0][1]
    assert "= 1 <unk> / s and a nominal <unk> k =" in lobster  # the formula stays in its article
    assert lobster.endswith("at sea level , 1,200-odd trials .")  # and so does the rest of it
    assert arts[1][1] == "M-82 is a state trunkline highway .\n= 3.5 x ="


def test_wikitext_titles_detokenised_like_texts():
    for raw in ("M @-@ 82", "1 @,@ 000 @.@ 5", "<unk> @-@ <unk>"):
        title = next(wikitext_articles(f" = {raw} = \n \n Body with {raw} . \n"))[0]
        assert title == wikitext_detok(raw)
        assert wikitext_detok(f"Body with {raw} .") == f"Body with {title} ."
    assert wikitext_detok("M @-@ 82 , 1 @,@ 000 @.@ 5") == "M-82 , 1,000.5"


def test_load_wikitext_file(tmp_path):
    f = tmp_path / "wiki.valid.tokens"
    f.write_text(WIKI + " \n = Empty = \n \n", encoding="utf-8")
    docs = list(load_wikitext([f]))
    assert [d.id for d in docs] == [
        "wiki.valid:Homarus gammarus", "wiki.valid:M-82 ( Michigan highway )",
        "wiki.valid:<unk> <unk>", "wiki.valid:<unk> <unk> (2)",
    ]
    assert [d.title for d in docs][:2] == ["Homarus gammarus", "M-82 ( Michigan highway )"]
    assert all(d.metadata == {"source": "wiki.valid.tokens"} for d in docs)
    assert "nominal <unk> k" in docs[0].text and "@" not in docs[0].text
    assert [d.text for d in docs[2:]] == ["First .", "Second ."]


def test_ir_metrics_follow_their_definitions():
    ranked = doc_ranking(["d3", "d1", "d3", "d2"])
    assert ranked == ["d3", "d1", "d2"]
    rels = {"d1": 1, "d2": 1}
    assert ndcg_at_k(ranked, rels, 10) == (1 / math.log2(3) + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    assert recall_at_k(ranked, rels, 2) == 0.5
    assert mrr_at_k(ranked, rels, 10) == 0.5
    assert mrr_at_k(ranked, {"zz": 1}, 10) == 0.0


def test_jsonl_and_beir_loaders(tmp_path):
    import json as _json

    import pytest

    from oprag_client.loaders import load_beir, load_jsonl

    (tmp_path / "a.jsonl").write_text(_json.dumps({"id": 7, "text": "t", "metadata": {"k": 1}}) + "\n\n")
    (tmp_path / "corpus.jsonl").write_text(_json.dumps({"_id": "d1", "title": "T", "text": "x", "metadata": {}}) + "\n")
    assert [(d.id, d.metadata) for d in load_jsonl([tmp_path / "a.jsonl"])] == [("7", {"k": 1})]  # typed metadata: a JSON number stays a number
    assert [(d.id, d.title) for d in load_beir([tmp_path])] == [("d1", "T")]
    (tmp_path / "bad.jsonl").write_text('{"text": "no id"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(load_jsonl([tmp_path / "bad.jsonl"]))


def test_byte_order_mark_is_not_text(tmp_path):
    import json as _json

    from oprag_client.loaders import load_jsonl

    (tmp_path / "bom.txt").write_bytes("\ufeffhello".encode("utf-8"))
    assert [d.text for d in load_text([tmp_path / "bom.txt"])] == ["hello"]
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + _json.dumps({"id": "a", "text": "x"}) + "\n").encode("utf-8"))
    assert [(d.id, d.text) for d in load_jsonl([tmp_path / "bom.jsonl"])] == [("a", "x")]


def test_text_folders_with_the_same_relative_names_are_refused(tmp_path):
    import pytest

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.txt").write_text(f"from {folder}")
    with pytest.raises(ValueError, match="both get the document id 'x.txt'.*separate calls would not help"):
        list(load_text([tmp_path / "a", tmp_path / "b"]))
    assert sorted(d.id for d in load_text([tmp_path])) == ["a/x.txt", "b/x.txt"]  # from the parent: distinct


def test_jsonl_wrong_field_types_name_file_and_line(tmp_path):
    import json as _json

    import pytest

    from oprag_client.loaders import load_jsonl

    for n, (obj, want) in enumerate([({"id": "a", "text": 5}, "text must be a string"),
                                     ({"id": "a", "text": "t", "title": ["x"]}, "title must be a string"),
                                     ({"id": {"x": 1}, "text": "t"}, "id must be a string or an integer"),
                                     ([1, 2], "must be a JSON object")]):
        p = tmp_path / f"bad{n}.jsonl"
        p.write_text(_json.dumps({"id": "ok", "text": "fine"}) + "\n" + _json.dumps(obj) + "\n")
        with pytest.raises(ValueError, match=f"bad{n}.jsonl:2: .*{want}"):
            list(load_jsonl([p]))


# ---------------------------------------------------------------- Parquet / Arrow (pyarrow writes them)
def _table(**cols):
    import pyarrow as pa

    return pa.table(cols)


def _write(tmp_path, table, kind: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / f"docs.{ {'parquet': 'parquet', 'arrow': 'arrow', 'stream': 'arrows'}[kind] }"
    if kind == "parquet":
        pq.write_table(table, p, row_group_size=2)  # several batches
    elif kind == "arrow":
        with pa.ipc.new_file(p, table.schema) as w:
            for b in table.to_batches(max_chunksize=2):
                w.write_batch(b)
    else:
        with pa.ipc.new_stream(p, table.schema) as w:
            w.write_table(table)
    return p


@pytest.mark.parametrize("kind", ["parquet", "arrow", "stream"])
def test_columnar_one_row_per_document(tmp_path, kind):
    import numpy as np
    import pyarrow as pa

    from oprag_client.loaders import LOADERS

    t = _table(id=pa.array(["a", "b", "c"]), text=["alpha", "beta", "gamma"], title=["A", None, "C"],
               metadata=pa.array(['{"year": 2020, "tag": "x"}', None, '{"ok": true}']),
               vector=pa.array([[1.0, 0.0, 0.5], None, [0.0, 2.0, 0.0]], pa.list_(pa.float64())))
    docs = list(LOADERS["arrow" if kind == "stream" else kind]([_write(tmp_path, t, kind)]))
    assert [(d.id, d.text, d.title) for d in docs] == [("a", "alpha", "A"), ("b", "beta", ""), ("c", "gamma", "C")]
    assert docs[0].metadata == {"year": 2020, "tag": "x"} and docs[2].metadata == {"ok": True}
    assert docs[0].vector.dtype == np.float32 and docs[0].vector.tolist() == [1.0, 0.0, 0.5]
    assert docs[1].vector is None  # null vector: the server embeds that one
    pb = docs[2].to_pb()  # numpy vectors go out in the packed form
    assert pb.vector_dim == 3 and np.frombuffer(pb.vectors_f32, "<f4").tolist() == [0.0, 2.0, 0.0]


def test_columnar_chunk_rows_group_by_doc_id(tmp_path):
    import pyarrow as pa

    from oprag_client.loaders import load_parquet

    vec = pa.array([[float(i), 1.0] for i in range(5)], pa.list_(pa.float32(), 2))  # fixed-size list
    t = _table(doc_id=pa.array([7, 7, 7, 8, 9]), text=["p1", "p2", "p3", "q1", "r1"], title=["T7", "x", "x", "T8", "T9"],
               metadata=pa.array([{"n": 1}, {"n": 2}, {"n": 3}, {"n": None}, {"n": 5}]), vector=vec)
    docs = list(load_parquet([_write(tmp_path, t, "parquet")]))
    assert [d.id for d in docs] == ["7", "8", "9"]
    assert [c[0] for c in docs[0].chunks] == ["p1", "p2", "p3"] and docs[0].title == "T7"
    assert [c[1].tolist() for c in docs[0].chunks] == [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]
    assert docs[0].metadata == {"n": 1} and docs[1].metadata == {}
    assert docs[0].to_pb().vector_dim == 2 and len(docs[0].to_pb().chunks) == 3


@pytest.mark.parametrize("table, message", [
    ("widths", "2 widths"),
    ("no_text", "no column 'text'"),
    ("null_chunk_vector", "row 1: chunk rows need a vector: give this row its chunk's vector"),
    ("split_doc", "row 2: the rows of document 'a' are not contiguous: sort or group the rows by doc_id"),
    ("strings", "must hold lists of numbers"),
    ("nan", "row 1: vector[1] is NaN: vector elements must be finite numbers"),
    ("inf_chunk_rows", "row 2: vector[0] is -Infinity: vector elements must be finite numbers"),
    ("big", "row 0: vector[0] is 1e+39, which overflows float32"),
    ("bad_metadata", "row 0"),
])
def test_columnar_errors_name_the_file_and_row(tmp_path, table, message):
    import pyarrow as pa

    from oprag_client.loaders import load_parquet

    tables = {
        "widths": dict(id=["a", "b", "c"], text=["x", "y", "z"], vector=[[1.0, 2.0], [1.0, 2.0], [1.0, 2.0, 3.0]]),
        "no_text": dict(id=["a"], vector=[[1.0]]),
        "null_chunk_vector": dict(doc_id=["a", "a"], text=["x", "y"], vector=pa.array([[1.0], None])),
        "split_doc": dict(doc_id=["a", "b", "a"], text=["x", "y", "z"], vector=[[1.0], [1.0], [1.0]]),
        "strings": dict(id=["a"], text=["x"], vector=[["1"]]),
        "nan": dict(id=["a", "b"], text=["x", "y"], vector=[[1.0, 2.0], [1.0, math.nan]]),
        "inf_chunk_rows": dict(doc_id=["a", "a", "b"], text=["x", "y", "z"], vector=[[1.0], [2.0], [-math.inf]]),
        "big": dict(id=["a"], text=["x"], vector=pa.array([[1e39, 1.0]], pa.list_(pa.float64()))),
        "bad_metadata": dict(id=["a"], text=["x"], metadata=["[1, 2]"]),
    }
    p = _write(tmp_path, _table(**tables[table]), "parquet")
    docs = load_parquet([p])
    with pytest.raises(ValueError, match=re.escape(message)) as ei:
        list(docs)
    assert str(p) in str(ei.value)


def test_columnar_width_check_comes_before_the_first_document(tmp_path):
    from oprag_client.loaders import load_parquet

    t = _table(id=[str(i) for i in range(6)], text=["x"] * 6, vector=[[1.0, 2.0]] * 5 + [[1.0]])
    it = load_parquet([_write(tmp_path, t, "parquet")])
    with pytest.raises(ValueError, match="2 widths"):
        next(it)  # nothing was handed out (so nothing can have been sent)


@pytest.mark.parametrize("rows", ["documents", "chunks"])
def test_a_named_vector_column_the_file_lacks_is_an_error_naming_the_columns(tmp_path, rows):
    from oprag_client.loaders import load_parquet

    key = "id" if rows == "documents" else "doc_id"
    p = _write(tmp_path, _table(**{key: ["a"], "text": ["x"], "vector": [[1.0, 2.0]]}), "parquet")
    with pytest.raises(ValueError, match=r"no column 'emb' \(columns: .*vector") as ei:
        list(load_parquet([p], "emb"))
    assert str(p) in str(ei.value)
    assert list(load_parquet([p]))[0].to_pb().vector_dim == 2  # unnamed: the file's 'vector' column


def test_cli_ingest_vector_column_missing_fails_before_connecting(tmp_path, capsys):
    from oprag_client import cli

    p = _write(tmp_path, _table(id=["a"], text=["x"], vector=[[1.0, 2.0]]), "parquet")
    rc = cli.main(["ingest", "--server", "127.0.0.1:1", "--format", "parquet", "--vector-column", "emb", str(p)])
    err = capsys.readouterr().err
    assert rc != 0 and "no column 'emb'" in err and "vector" in err
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--vector-column", "emb", str(p)]) != 0
    assert "looks like --format parquet input" in capsys.readouterr().err  # (no --format: trial35)
    (tmp_path / "t.txt").write_text("x")
    assert cli.main(["ingest", "--server", "127.0.0.1:1", "--vector-column", "emb", str(tmp_path / "t.txt")]) != 0
    assert "--vector-column is for --format parquet or arrow" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl", "beir", "wikitext", "parquet"])
def test_a_file_of_another_format_is_named_with_what_to_use(tmp_path, fmt):
    """trial14: a Parquet file given as --format jsonl said only "'utf-8' codec can't decode byte
    0x88 in position 92: invalid start byte", and a JSON-lines file given as --format parquet
    "Parquet magic bytes not found in footer": neither named the file."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from oprag_client.loaders import LOADERS

    pq.write_table(pa.table({"id": ["a"], "text": ["x"], "n": [2**40 + 0x88]}), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text('{"id": "a", "text": "x"}\n')
    f = tmp_path / ("d.jsonl" if fmt == "parquet" else "d.parquet")
    with pytest.raises(ValueError) as ei:
        list(LOADERS[fmt]([f]))
    msg = str(ei.value)
    assert msg.startswith(f"{f}") and ("not a Parquet file" if fmt == "parquet" else "not UTF-8 text") in msg
    if fmt in ("jsonl", "beir"):
        assert "--format parquet" in msg


@pytest.mark.parametrize("given, written", [("parquet", "arrow file"), ("parquet", "arrow stream"),
                                           ("arrow", "parquet")])
def test_a_columnar_file_given_as_the_other_columnar_format_says_which_it_is(tmp_path, given, written):
    """trial43 #3: an Arrow IPC file given as --format parquet got pyarrow's "Parquet magic bytes not found in
    footer" with nothing on what to send instead; the file's first bytes name its format."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from oprag_client.loaders import LOADERS

    t, f = pa.table({"id": ["a"], "text": ["x"]}), tmp_path / "d.bin"
    if written == "parquet":
        pq.write_table(t, f)
    else:
        with pa.OSFile(str(f), "wb") as sink, (pa.ipc.new_file if written == "arrow file" else pa.ipc.new_stream)(
                sink, t.schema) as w:
            w.write_table(t)
    with pytest.raises(ValueError) as ei:
        list(LOADERS[given]([f]))
    want = "use --format parquet" if written == "parquet" else "use --format arrow"
    assert str(ei.value).startswith(str(f)) and want in str(ei.value), str(ei.value)
    (tmp_path / "j.bin").write_text('{"id": "a", "text": "x"}\n')  # (no columnar magic: no suggestion)
    with pytest.raises(ValueError) as ei:
        list(LOADERS[given]([tmp_path / "j.bin"]))
    assert "use --format" not in str(ei.value)


@pytest.mark.parametrize("given, head", [("parquet", b"PAR1"), ("arrow", b"ARROW1"), ("arrow", b"\xff\xff\xff\xff")])
def test_a_damaged_file_of_the_given_format_is_called_damaged_with_its_name(tmp_path, given, head):
    """trial44 #8 / #9: a file that starts with the given format's magic but is cut short was told to use that same
    --format; random bytes given as --format arrow raised pyarrow's OSError without the file's name."""
    pytest.importorskip("pyarrow")
    from oprag_client.loaders import LOADERS

    f = tmp_path / "cut.bin"
    f.write_bytes(head + b" not really" + bytes(range(7, 200)))
    with pytest.raises(ValueError) as ei:
        list(LOADERS[given]([f]))
    msg = str(ei.value)
    assert msg.startswith(str(f)) and "damaged or cut short" in msg and "use --format" not in msg, msg
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes((i * 97 + 13) % 256 for i in range(4096)))
    with pytest.raises(ValueError) as ei:
        list(LOADERS[given]([noise]))
    assert str(ei.value).startswith(str(noise)), str(ei.value)


@pytest.mark.parametrize("chunks, words", [
    ([{"text": "a"}], 'chunks[0] has no "vector" (its keys: "text"): each chunk is an object {"text": "...", "vector": [numbers]}'),
    ([{"text": "a", "vector": [0.1]}, {"vector": [0.2]}], 'chunks[1] has no "text"'),
    ([["a", [0.1]]], 'chunks[0] must be an object {"text": "...", "vector": [numbers]}, got ["a", [0.1]]'),
    ("abc", 'chunks must be a list of {"text", "vector"} objects, got "abc"'),
])
def test_jsonl_chunks_of_the_wrong_shape_say_what_a_chunk_is(tmp_path, chunks, words):
    """trial14: these said "expected a JSON object with id and text ('vector')" (or "list indices
    must be integers"), though id and text were not the problem."""
    import json as _json

    from oprag_client.loaders import load_jsonl

    (tmp_path / "c.jsonl").write_text(_json.dumps({"id": "c", "chunks": chunks}) + "\n")
    with pytest.raises(ValueError) as ei:
        list(load_jsonl([tmp_path / "c.jsonl"]))
    assert str(ei.value).startswith(f"{tmp_path / 'c.jsonl'}:1: {words}"), str(ei.value)
    assert "id and text" not in str(ei.value)


def test_a_jsonl_line_with_chunks_and_its_own_text_or_vector_names_the_line(tmp_path):
    """trial28b #3: the loader passed it on and the server rejected the document after the
    stream's other documents were stored; now the file's line is named before anything is sent."""
    rows = [{"id": "ok", "chunks": [{"text": "c", "vector": [1.0, 0.0]}]},
            {"id": "both", "text": "t", "vector": [0.0, 1.0], "chunks": [{"text": "c", "vector": [1.0, 0.0]}]}]
    p = tmp_path / "mixed.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=re.escape("mixed.jsonl:2: a document with chunks carries its text and vectors "
                                                   "in them: leave out its text and vector")):
        list(load_jsonl([p]))


def test_jsonl_names_a_field_it_ignores_once_per_file(tmp_path, capsys):
    """A misspelt field ("titel") was dropped without a word (trial34): it is still ignored (the
    document loads), with one line on stderr per unknown name and file; BEIR's extra fields stay quiet."""
    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "a", "text": "x", "titel": "T"}\n{"id": "b", "text": "y", "titel": "U", "url": "u"}\n'
                 '{"id": "c", "text": "z", "title": "ok"}\n', encoding="utf-8")
    docs = list(load_jsonl([p]))
    assert [(d.id, d.title) for d in docs] == [("a", ""), ("b", ""), ("c", "ok")]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"oprag: {p}:1: ignoring field(s) 'titel': a line's fields are chunks, id, metadata, text, title, vector",
                   f"oprag: {p}:2: ignoring field(s) 'url': a line's fields are chunks, id, metadata, text, title, vector"]
    from oprag_client.loaders import load_beir

    (tmp_path / "corpus.jsonl").write_text('{"_id": "d", "title": "", "text": "w", "extra": 1}\n', encoding="utf-8")
    assert [d.id for d in load_beir([tmp_path / "corpus.jsonl"])] == ["d"] and not capsys.readouterr().err


@pytest.mark.parametrize("row, words", [
    ({"id": "m1", "txt": "hello", "titel": "x"}, "no 'text' field (the line's fields: 'id', 'txt', 'titel')"),
    ({"text": "hello"}, "no 'id' field (the line's fields: 'text')"),
    ({}, "no 'id' and no 'text' field (the line's fields: none)"),
    ({"_id": "b1", "title": "", "text": "w"},  # trial50: a BEIR line under --format jsonl
     "no 'id' field (the line's fields: '_id', 'title', 'text'); a BEIR corpus line ('_id'): use --format beir"),
])
def test_a_jsonl_line_without_id_or_text_names_what_it_lacks_and_what_it_has(tmp_path, row, words):
    """trial35: a misspelt field said "expected a JSON object with id and text ('text')" (the
    bare KeyError), not that ``text`` was missing nor which fields the line had."""
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"id": "ok", "text": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as ei:
        list(load_jsonl([p]))
    assert str(ei.value) == f"{p}:2: {words}", str(ei.value)
