"""Rules of the memory benchmark's conversation sets (bench/memory_sets.py) on a small
synthetic WikiText file, and the memory operator's list fusion."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.memory_sets import KINDS, TEMPLATES, build, wikitext_articles, words  # noqa: E402
from oprag_server.domain import Hit  # noqa: E402
from oprag_server.operators.memory import context_text, fuse_lists  # noqa: E402
from oprag_server.shards.protocol import MemoryTurn  # noqa: E402

SHARED = ["harbour", "granite", "festival", "railway", "orchard", "lantern", "meadow", "quarry", "glacier", "vineyard"]


def _article(k: int) -> str:
    paras = []
    for p in range(4):
        own = " ".join(f"uniq{chr(97 + k)}{chr(97 + p)}{chr(97 + i)}word" for i in range(6))
        filler = " ".join(["lorem ipsum dolor sit amet"] * 14)
        shared = SHARED[(k + p) % len(SHARED)] if p else ""
        paras.append(f" {filler} {own} the {shared} stands here . {filler} \n")
    return f" = {chr(65 + k % 26)}{chr(97 + k // 26)}vania = \n\n" + "\n".join(paras) + "\n"


def test_every_kind_follows_its_rules(tmp_path):
    f = tmp_path / "wiki.txt"
    f.write_text("".join(_article(k) for k in range(30)), encoding="utf-8")
    arts = wikitext_articles(f)
    for family in TEMPLATES:
        convs = build(arts, family)
        assert {c.kind for c in convs} == set(KINDS)
        for c in convs:
            title = next(t for d, t, _ in arts if d == c.doc_id)
            tw = set(words(title))
            last = set(words(c.turns[-1]))
            assert c.target.startswith(c.doc_id + "#") and not c.target.endswith("#0")
            assert tw <= set(words(c.oracle))  # the oracle writes the subject out
            if c.kind in ("pronoun", "nopronoun", "chain"):
                assert not tw & last and tw <= set(words(c.turns[0]))  # subject only in turn 1
            if c.kind == "nopronoun":
                assert not last & {"it", "its", "they", "them", "their", "this", "that"}
            if c.kind == "chain":
                assert len(c.turns) == 3 and c.targets[1] != c.targets[2] and not tw & set(words(c.turns[1]))
            if c.kind == "selfcontained":
                assert tw <= last and last & {"it", "they"} and not tw & set(words(c.turns[0]))
            if c.kind == "switch":
                assert len(c.turns) == 3 and tw <= last and c.targets[1].split("#")[0] != c.doc_id


def _hit(cid: str) -> Hit:
    return Hit(cid, cid.split("#")[0], "", "", 0.0, 0.0, 0.0, 0)


def test_fusion_prefers_what_both_lists_rank_and_keeps_agreeing_questions():
    own = [_hit(c) for c in ("x#1", "z#2", "y#0")]
    ctx = [_hit(c) for c in ("z#2", "z#1", "x#1")]
    assert [h.chunk_id for h in fuse_lists(own, ctx, 2)] == ["z#2", "x#1"]
    agree = [_hit(c) for c in ("x#2", "x#1")]
    assert [h.chunk_id for h in fuse_lists(own, agree, 3)] == ["x#1", "z#2", "y#0"]  # same top document


def test_context_keeps_the_resolved_subject_and_decays_old_turns():
    t = lambda q, title, terms=(): MemoryTurn(0, q, "", ["c#0"], [title], q, ["c"], list(terms))  # noqa: E731
    turns = [t("And for its battery?", "", ["z900"]), t("What is the Z900 warranty?", "", ["z900", "warranty"])]
    assert context_text("And for its battery?", turns) == "And for its battery? z900 z900 warranty"
    assert context_text("q", [t("a", "Du Fu"), t("b", "Du Fu"), t("c", "Wang Wei")]) == "q Du Fu"  # distinct
    assert context_text("q", [t("a", "Du Fu"), t("b", "Li Bai"), t("c", "Wang Wei")]) == "q Du Fu Li Bai"  # 0.25 < 0.5
    assert context_text("q", []) == ""
