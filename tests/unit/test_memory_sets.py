"""Rules of the memory benchmark's conversation sets (bench/memory_sets.py) on a small
synthetic WikiText file, and the memory operator's list fusion."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.memory_sets import KINDS, ROWS, TEMPLATES, build, headline, wikitext_articles, words  # noqa: E402
from oprag_server.domain import Hit  # noqa: E402
from oprag_server.operators.memory import context_text, fuse_lists, row_weights  # noqa: E402
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


def test_fusion_combines_by_max_and_keeps_agreeing_questions():
    # CombMAX: x#1 (own rank 1, context rank 3) is not counted twice; equal evidence, so own rank 1
    # ties with context rank 1 and the better own rank wins
    own = [_hit(c) for c in ("x#1", "z#2", "y#0")]
    ctx = [_hit(c) for c in ("z#2", "z#1", "x#1")]
    assert [h.chunk_id for h in fuse_lists(own, ctx, 2)] == ["x#1", "z#2"]
    # the context row has more evidence: its top hit leads although the own top hit is in both lists
    # (a sum would give x#1 0.875/11 + 1/12 > z#2's 1/11)
    strong = [dataclasses.replace(_hit(c), dense_score=0.8) for c in ("z#2", "x#1", "z#1")]
    weak = [dataclasses.replace(_hit(c), dense_score=0.7) for c in ("x#1", "y#0", "y#1")]
    assert fuse_lists(weak, strong, 2)[0].chunk_id == "z#2"
    agree = [_hit(c) for c in ("x#2", "x#1")]
    assert [h.chunk_id for h in fuse_lists(own, agree, 3)] == ["x#1", "z#2", "y#0"]  # same top document


def test_context_keeps_the_resolved_subject_and_decays_old_turns():
    t = lambda q, title, terms=(): MemoryTurn(0, q, "", ["c#0"], [title], q, ["c"], list(terms))  # noqa: E731
    turns = [t("And for its battery?", "", ["z900"]), t("What is the Z900 warranty?", "", ["z900", "warranty"])]
    assert context_text("And for its battery?", turns) == "And for its battery? z900 z900 warranty"
    assert context_text("q", [t("a", "Du Fu"), t("b", "Du Fu"), t("c", "Wang Wei")]) == "q Du Fu"  # distinct
    assert context_text("q", [t("a", "Du Fu"), t("b", "Li Bai"), t("c", "Wang Wei")]) == "q Du Fu Li Bai"  # 0.25 < 0.5
    assert context_text("q", []) == ""


def _scored(cid: str, dense: float) -> Hit:
    return Hit(cid, cid.split("#")[0], "", "", 0.0, dense, 0.0, 0)


def test_a_question_without_evidence_defers_to_its_session_and_one_with_evidence_keeps_its_list():
    # "Tell me more about it." over five one-chunk documents: cosine ~0.1 to every chunk, its
    # own list a near-tie that happens to start with b; the session context finds a at 0.7
    ctx = [_scored("a#0", 0.70), _scored("b#0", 0.04), _scored("c#0", 0.20), _scored("d#0", 0.03), _scored("e#0", 0.03)]
    weak = [_scored("b#0", 0.11), _scored("d#0", 0.08), _scored("c#0", 0.03), _scored("e#0", 0.03), _scored("a#0", 0.00)]
    assert row_weights(weak, ctx) == (0.11 / 0.70, 1.0)
    assert [h.chunk_id for h in fuse_lists(weak, ctx, 2)] == ["a#0", "b#0"]
    # the same lists with equal evidence: the head of the question's own list stays first
    strong = [dataclasses.replace(h, dense_score=0.70 if h.chunk_id == "b#0" else h.dense_score) for h in weak]
    assert row_weights(strong, ctx) == (1.0, 1.0)
    assert fuse_lists(strong, ctx, 1)[0].chunk_id == "b#0"
    assert row_weights([], []) == (1.0, 1.0) and row_weights(weak, [_scored("a#0", -0.2)]) == (1.0, 0.0)


def test_headline_pools_kinds_and_a_custom_split_names_the_targets(tmp_path):
    f = tmp_path / "wiki.txt"
    f.write_text("".join(_article(k) for k in range(30)), encoding="utf-8")
    arts = wikitext_articles(f)
    halves = lambda body: [p for p in body.split("\n") if p.strip()]  # noqa: E731 - one window per paragraph
    convs = build(arts, 0, split=halves)
    bodies = {d: b for d, _, b in arts}
    for c in convs:
        assert c.target in {f"{c.doc_id}#{i}" for i in range(1, len(halves(bodies[c.doc_id])))}
    res = {k: {r: [] for r in ROWS} for k in KINDS}
    for k, hit in (("pronoun", True), ("chain", False), ("selfcontained", True), ("switch", False)):
        for r in ROWS:
            res[k][r].append(hit if r != "oracle" else True)
    out = headline(res, [True])
    assert out["followup_top1_with"] == 0.5 and out["followup_top1_oracle"] == 1.0
    assert out["chain_turn3_top1_with"] == 0.0 and out["chain_turn2_top1_with"] == 1.0
    assert out["selfcontained_top1_with"] == 0.5 and out["per_kind"]["nopronoun"]["n"] == 0


def test_the_fusion_picks_the_subject_and_the_question_picks_its_passage():
    from oprag_server.index.analyzer import Analyzer

    names = Analyzer().tokens

    def hit(cid, title, text, dense):
        return Hit(cid, cid.split("#")[0], title, text, 0.0, dense, 0.0, 0)

    # "Explain the battery." after a turn about the Z900: the context row finds the Z900 manual but
    # ranks its overview first; the question's own list is a weak tie elsewhere
    ctx = [hit("z#0", "Z900 manual", "Z900 overview: warranty, price.", 0.6),
           hit("z#2", "Z900 manual", "Z900 battery: 12 months.", 0.5), hit("z#1", "Z900 manual", "Z900 price.", 0.5)]
    own = [hit("x#3", "X100 manual", "Garden hose price.", 0.2), hit("x#4", "X100 manual", "Hose reel.", 0.2)]
    assert [h.chunk_id for h in fuse_lists(own, ctx, 3)] == ["z#0", "z#2", "z#1"]  # the name decides
    got = fuse_lists(own, ctx, 3, question="Explain the battery.", names=names)
    assert [h.chunk_id for h in got] == ["z#2", "z#0", "z#1"]  # same positions, the question's passage first
    # the title's own terms do not count (every passage of the subject has them); other documents stay put
    got = fuse_lists(own, ctx[::2], 3, question="Explain the Z900.", names=names)
    assert [h.chunk_id for h in got] == [h.chunk_id for h in fuse_lists(own, ctx[::2], 3)]


def test_the_context_row_reuses_the_stored_turn_vectors_instead_of_a_second_encoder_row():
    import numpy as np

    from oprag_server.operators.memory import context_vector, session_vector

    e = np.eye(4, dtype=np.float32)
    t = lambda v: MemoryTurn(0, "q", "", ["c#0"], ["T"], "q", ["c"], [], v)  # noqa: E731
    # newest first, weight 0.5 ** age, turns under 0.5 left out (as their subjects are)
    s = session_vector([t(e[0]), t(e[1]), t(e[2])])
    assert np.allclose(s, (e[0] + 0.5 * e[1]) / np.linalg.norm(e[0] + 0.5 * e[1])) and s.dtype == np.float32
    assert session_vector([t(e[0]), t(None)]) is None and session_vector([]) is None  # old record: embed the text
    v = context_vector(e[3], s)
    assert np.isclose(np.linalg.norm(v), 1.0) and np.isclose(v @ e[3], v @ s)  # halfway between question and session


def test_a_filler_word_common_in_the_corpus_does_not_outweigh_the_asked_about_word():
    from oprag_server.index.analyzer import Analyzer

    names = Analyzer().tokens

    def hit(cid, text):
        return Hit(cid, cid.split("#")[0], "Lobster", text, 0.0, 0.5, 0.0, 0)

    # "Can you find the part where it talks about direction?": among the candidates "part" and
    # "find" are as rare as "direction", so the passage with both filler words would win; in the
    # corpus they are common (low idf) and "direction" is rare
    ctx = [hit("l#0", "Lobster overview."), hit("l#1", "Find the part on claws."), hit("l#2", "The direction of travel.")]
    own = [dataclasses.replace(hit("s#0", "A song."), title="Song", dense_score=0.2)]  # no evidence: defers
    q = "Can you find the part where it talks about direction?"
    assert fuse_lists(own, ctx, 3, question=q, names=names)[0].chunk_id == "l#1"  # candidates alone
    corpus = {"find": 0.2, "part": 0.2, "the": 0.1, "direction": 3.0}
    got = fuse_lists(own, ctx, 3, question=q, names=names, corpus_idf=lambda ts: [corpus.get(t, 1.0) for t in ts])
    assert got[0].chunk_id == "l#2"


def test_the_kept_analysis_leaves_every_fused_ranking_unchanged():
    """Replay of 400 generated fusion cases (random lists over a shared vocabulary, an idf that
    varies by term): the cached analysis (cold and then warm, one cache across all cases, 64
    texts so it also evicts) gives the very lists (ids, order, scores) of the uncached one."""
    import random

    from oprag_server.index.analyzer import Analyzer
    from oprag_server.operators import memory

    names, rng = Analyzer().tokens, random.Random(17)
    vocab = [f"w{i}" for i in range(40)] + SHARED
    idf = lambda ts: [1.0 + (sum(map(ord, t)) % 7) / 3 for t in ts]  # noqa: E731
    texts = [" ".join(rng.sample(vocab, 8)) for _ in range(120)]

    def row(n):
        return [Hit(f"d{d}#{c}", f"d{d}", f"Title {vocab[d]}" if d % 3 else "", texts[(d * 7 + c) % len(texts)],
                    0.0, rng.random(), 0.0, 0) for d, c in ((rng.randrange(12), rng.randrange(6)) for _ in range(n))]

    memory._token_caches.clear()
    cases = [(list({h.chunk_id: h for h in row(20)}.values()), list({h.chunk_id: h for h in row(20)}.values()),
              " ".join(rng.sample(vocab, 5))) for _ in range(400)]
    fused = 0
    for own, ctx, q in cases:
        ref = fuse_lists(own, ctx, 5, question=q, names=names, corpus_idf=idf, cache=0)
        for _ in range(2):  # cold, then warm
            got = fuse_lists(own, ctx, 5, question=q, names=names, corpus_idf=idf, cache=64)
            assert [(h.chunk_id, h.score) for h in got] == [(h.chunk_id, h.score) for h in ref]
        fused += ref[0].chunk_id != own[0].chunk_id
    assert fused > 50  # the cases exercise the fusion, not only the agreeing shortcut
    assert 0 < len(memory._token_caches[names]) <= 64
