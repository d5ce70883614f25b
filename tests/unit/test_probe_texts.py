"""bench._common.probe_texts: the query generators of the in-process recall probe follow their
stated rules on a small shared-data layout the test writes itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench._common import QUERY_SOURCES, probe_texts  # the repository root is on sys.path under pytest


def _shared(tmp_path: Path) -> Path:
    wiki = tmp_path / "data" / "wikitext-2"
    sci = tmp_path / "data" / "scifact"
    (sci / "qrels").mkdir(parents=True)
    wiki.mkdir(parents=True)
    paras = [" = Heading One = "]
    for i in range(30):
        long = " ".join(f"word{j} river{i} harbour" for j in range(4))  # 12 tokens
        paras.append(f" {long} . short one . {long} castle{i} keep")
    wiki.joinpath("valid.txt").write_text("\n".join(paras) + "\n", encoding="utf-8")
    docs = [{"_id": str(i), "title": f"t{i}", "text": f"Cells of type {i} express protein kinase in mice tissue. "
             f"No. Tumour growth slowed markedly after treatment number {i} in every cohort studied.", "metadata": {}}
            for i in range(20)]
    sci.joinpath("corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    qs = [{"_id": str(100 + i), "text": f"query number {i} about kinase", "metadata": {}} for i in range(5)]
    sci.joinpath("queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs), encoding="utf-8")
    sci.joinpath("qrels", "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\r\n" + "".join(f"{100 + i}\t{i}\t1\r\n" for i in range(5)), encoding="utf-8")
    return tmp_path


def test_every_generator_is_seeded_and_follows_its_rule(tmp_path):
    shared = _shared(tmp_path)
    wiki = (shared / "data" / "wikitext-2" / "valid.txt").read_text("utf-8")
    corpus = (shared / "data" / "scifact" / "corpus.jsonl").read_text("utf-8")
    assert probe_texts("scifact", 3, shared) == [f"query number {i} about kinase" for i in range(3)]
    for src in ("wikitext", "scifact-sentences"):
        a, b = probe_texts(src, 10, shared, seed=1), probe_texts(src, 10, shared, seed=1)
        assert a == b and len(a) == 10 and len(set(a)) == 10
        assert a != probe_texts(src, 10, shared, seed=2)
        for s in a:
            assert 8 <= len(s.split()) <= 40  # "short one", "No", the heading: never drawn
            assert s in (wiki if src == "wikitext" else corpus)
            assert "=" not in s
    terms = probe_texts("terms", 50, shared, seed=3)
    assert terms == probe_texts("terms", 50, shared, seed=3)
    text = (wiki + corpus).lower()
    for q in terms:
        words = q.split()
        assert 2 <= len(words) <= 4 and len(set(words)) == len(words)
        for w in words:
            assert re.fullmatch(r"[a-z]{4,}", w) and w in text


def test_an_unknown_source_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="use one of " + ", ".join(QUERY_SOURCES)):
        probe_texts("fiqa", 3, _shared(tmp_path))
