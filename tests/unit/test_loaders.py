"""Client-side loaders and evaluation metrics."""

from __future__ import annotations

import math

from oprag_client.evaluate import doc_ranking, mrr_at_k, ndcg_at_k, recall_at_k
from oprag_client.loaders import load_text, load_wikitext, wikitext_articles, wikitext_detok


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
    with pytest.raises(ValueError, match="both get the document id 'x.txt'"):
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
