"""Conversation sets for the memory benchmark, built from any WikiText file (or any list of
titled articles) by rules that do not depend on the memory operator's implementation.

Rules (deterministic)
---------------------
1. Articles: ``(title, body)`` pairs (``oprag_client.loaders.load_wikitext`` for a WikiText
   file). Windows: ``chunk_text(body, 900)`` (character windows; a window that is only
   whitespace is dropped), or any ``split`` given to :func:`build` (bench/memory.py passes the
   server's chunker, 256 MiniLM tokens). The chunk id of window ``i`` of document ``d`` is ``d#i``.
2. Words: casefolded letter runs (``[^\\W\\d_]+``) of >= 4 letters; a word touching a window's
   start or end is ignored for that window. ``df`` = articles whose body has the word. Words in
   more than ``COMMON_DF`` of the articles are never keywords (a frequency rule, no stop list);
   nor is ``unk`` (WikiText's unknown-word token) nor a word of the title.
3. A window's keywords: its words that occur in no other window of its article, sorted by
   ``(df ascending, first position)``. Its *shared keyword* ``w`` is the first with
   ``df >= SHARED_MIN_DF`` (it also occurs in other articles: alone it does not say which
   article is meant, so the question is underspecified without its subject).
   3b. Family 2 asks instead about the shared keyword with the *highest* df (the last one in
   that order): the most ambiguous word alone.
   3c. Family 3 (the hold-out family) asks about the middle one of that order (index ``len // 2``).
4. An article is eligible when its title has no ``<unk>``, is not repeated, and it has at least
   two windows other than the first with >= 300 characters and a shared keyword: targets ``A``
   and ``B`` are the first two such windows after rotating the list by ``sha256(title) %
   len``.  Every eligible article gets a *partner*: the next eligible article in file order
   (cyclic), used for the self-contained and topic-switch sessions. With ``roles=2`` (the
   default) every article gives each kind two conversations, the second with ``A`` and ``B``
   swapped (twice the conversations per kind: a 27-conversation kind moves 3.7 points per
   conversation).
5. Conversations (``T`` title, ``P`` the partner's title, ``wA``/``wB`` the shared keywords of
   A/B, ``wP`` the partner's ``wA``); template family ``0``-``3`` (``--family``) picks the
   wording, each kind keeps its defining property in both:

   ===================  ====================================  ===================================
   kind                 turns (target = last turn's window)   property
   ===================  ====================================  ===================================
   ``pronoun``          first(T); "What about its wA?"         subject implicit, a pronoun
   ``nopronoun``        first(T); "And the wA?"                subject implicit, no pronoun
   ``chain``            first(T); nopronoun(wA); "What about   turn 3 keeps the subject of turn 1
                        wB?"                                   through turn 2
   ``selfcontained``    first(P); "What does T say about wA,   names its own subject T, contains
                        and why is it notable?"                "it"/"they", session is about P
   ``switch``           first(P); nopronoun(wP); "What does    topic switch inside a session
                        T say about wA?"
   ===================  ====================================  ===================================

   Each conversation also carries ``oracle`` (its last question with the subject written out,
   asked with no session) and ``naive`` (the previous question + the last question, no session).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from . import _internals

WINDOW_CHARS = 900
MIN_TARGET_CHARS = 300
SHARED_MIN_DF = 3
COMMON_DF = 0.2  # a word in more than this fraction of the articles is never a keyword
KINDS = ("pronoun", "nopronoun", "chain", "selfcontained", "switch")
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)

# template family -> kind -> format strings; {T} title, {w} keyword
TEMPLATES = {
    0: {"first": "What is {T}?", "pronoun": "What about its {w}?", "nopronoun": "And the {w}?",
        "chain3": "What about {w}?", "self": "What does {T} say about {w}, and why is it notable?",
        "switch": "What does {T} say about {w}?", "oracle": "What about the {w} of {T}?"},
    1: {"first": "Give me an overview of {T}.", "pronoun": "How does {w} relate to it?",
        "nopronoun": "Tell me more about {w}.", "chain3": "Anything on {w} too?",
        "self": "How do they describe {w} in {T}?", "switch": "Now about {T}: what of {w}?",
        "oracle": "Tell me more about {w} in {T}."},
    # family 2: other rules as well as other words -- the keyword is the shared one with the
    # highest df (the most ambiguous alone, rule 3b), imperative and long first turns, a
    # two-word imperative follow-up, a long chain turn, the subject named mid-sentence
    2: {"first": "Summarize the article on {T} for me, please.",
        "pronoun": "Can you find the part where it talks about {w}?",
        "nopronoun": "Explain {w}.", "chain3": "Next I would like the passage that covers {w}, if there is one.",
        "self": "Explain what {T} says about {w}; is it important there?",
        "switch": "Different topic: describe {w} in the article on {T}.", "oracle": "Explain {w} in {T}."},
    # family 3: the hold-out family, written before the fourth pass's mechanism was chosen and run
    # once after it (bench/RESULTS.md): the keyword is the *median*-df shared word (rule 3c),
    # questions phrased unlike 0-2 (a bare noun phrase, "mention", a subject in a subordinate clause)
    3: {"first": "I am reading up on {T}.", "pronoun": "Where does it mention {w}?",
        "nopronoun": "Any details on {w}?", "chain3": "Also {w}.",
        "self": "Since {T} is my subject, what is said about {w} and does it matter?",
        "switch": "Switching subjects: how does the {T} article treat {w}?",
        "oracle": "{w} in {T}"},
}
# family -> which shared keyword of a window is asked about (rule 3 / 3b; "mid": rule 3c, the
# middle one of the df-ascending order)
KEYWORD_PICK = {0: 0, 1: 0, 2: -1, 3: "mid"}


@dataclass
class Conversation:
    kind: str
    doc_id: str
    turns: list[str]  # questions in session order; the last one is scored
    target: str  # chunk id of the last turn's target window
    oracle: str
    naive: str
    targets: list[str] = field(default_factory=list)  # per turn (first turn: "")


def words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


def _window_words(win: str) -> list[str]:
    """Words of a window in order, without one that touches the start or the end."""
    out = []
    for m in _WORD.finditer(win):
        if m.start() == 0 or m.end() == len(win) or len(m.group()) < 4:
            continue
        out.append(m.group())
    return out


def windows(body: str) -> list[str]:
    return [w for w in _internals.chunk_chars(body, WINDOW_CHARS, 0) if w.strip()]


def build(articles: list[tuple[str, str, str]], family: int = 0, split=None, roles: int = 2) -> list[Conversation]:
    """Conversations over ``articles`` ``[(doc_id, title, body)]`` (rules in the module doc).
    ``split(body) -> [window]`` cuts the windows (default :func:`windows`, 900 characters;
    over gRPC the server's own chunker, so that window ``i`` is stored chunk ``d#i``);
    ``roles`` 1 (targets ``A``, ``B``) or 2 (also ``B``, ``A``) conversations per article and kind.

    :raises KeyError: unknown template ``family``.
    """
    tpl, pick = TEMPLATES[family], KEYWORD_PICK[family]
    n = len(articles)
    df: dict[str, int] = {}
    for _, _, body in articles:
        for w in set(words(body)):
            df[w] = df.get(w, 0) + 1
    counts: dict[str, int] = {}
    for _, t, _ in articles:
        counts[t] = counts.get(t, 0) + 1
    picked = []  # (doc_id, title, [(window index, shown keyword)] for A, B)
    for doc_id, title, body in articles:
        if "<unk>" in title or counts[title] > 1:
            continue
        wins = (split or windows)(body)
        per = [set(w.casefold() for w in _window_words(x)) for x in wins]
        tw = set(words(title))
        cands = []
        for i, win in enumerate(wins):
            if i == 0 or len(win) < MIN_TARGET_CHARS:
                continue
            others = set().union(*(p for j, p in enumerate(per) if j != i)) if len(per) > 1 else set()
            seen, kws = set(), []
            for pos, shown in enumerate(_window_words(win)):
                k = shown.casefold()
                if k in seen or k in others or k in tw or k == "unk" or df.get(k, 0) > COMMON_DF * n:
                    continue
                seen.add(k)
                kws.append((df.get(k, 0), pos, shown))
            shared = [s for d, _, s in sorted(kws) if d >= SHARED_MIN_DF]
            if shared:
                cands.append((i, shared[len(shared) // 2] if pick == "mid" else shared[pick]))
        if len(cands) < 2:
            continue
        h = int(hashlib.sha256(title.encode("utf-8")).hexdigest(), 16) % len(cands)
        rot = cands[h:] + cands[:h]
        picked.append((doc_id, title, rot[:2]))
    out: list[Conversation] = []
    for role, k in ((r, k) for r in range(roles) for k in range(len(picked))):
        doc_id, title, ab = picked[k]
        pdoc, ptitle, pab = picked[(k + 1) % len(picked)]
        (ia, wa), (ib, wb) = ab if role == 0 else ab[::-1]
        ipa, wpa = pab[role]
        if pdoc == doc_id:
            continue
        ta, tb, tpa = f"{doc_id}#{ia}", f"{doc_id}#{ib}", f"{pdoc}#{ipa}"
        first, pfirst = tpl["first"].format(T=title), tpl["first"].format(T=ptitle)
        oracle_a = tpl["oracle"].format(T=title, w=wa)
        pro, nop = tpl["pronoun"].format(w=wa), tpl["nopronoun"].format(w=wa)
        c3 = tpl["chain3"].format(w=wb)
        self_q = tpl["self"].format(T=title, w=wa)
        sw_mid, sw_q = tpl["nopronoun"].format(w=wpa), tpl["switch"].format(T=title, w=wa)
        out += [
            Conversation("pronoun", doc_id, [first, pro], ta, oracle_a, f"{first} {pro}", ["", ta]),
            Conversation("nopronoun", doc_id, [first, nop], ta, oracle_a, f"{first} {nop}", ["", ta]),
            Conversation("chain", doc_id, [first, nop, c3], tb, tpl["oracle"].format(T=title, w=wb), f"{nop} {c3}",
                         ["", ta, tb]),
            Conversation("selfcontained", doc_id, [pfirst, self_q], ta, self_q, f"{pfirst} {self_q}", ["", ta]),
            Conversation("switch", doc_id, [pfirst, sw_mid, sw_q], ta, sw_q, f"{sw_mid} {sw_q}", ["", tpa, ta]),
        ]
    return out


def wikitext_articles(path) -> list[tuple[str, str, str]]:
    """``[(doc_id, title, body)]`` of a WikiText file (``load_wikitext``)."""
    from pathlib import Path

    from oprag_client.loaders import load_wikitext

    return [(d.id, d.title, d.text) for d in load_wikitext([Path(path)])]


FOLLOWUP_KINDS = ("pronoun", "nopronoun", "chain")
SELF_KINDS = ("selfcontained", "switch")
ROWS = ("with", "without", "oracle", "naive")


def headline(res: dict[str, dict[str, list[bool]]], chain2: list[bool]) -> dict:
    """The issue's figures from per-kind Top-1 outcomes ``res[kind][row]`` (rows :data:`ROWS`:
    memory on, memory off, oracle, naive prepend) and the chain's turn-2 outcomes: means over
    the follow-up kinds (:data:`FOLLOWUP_KINDS`, chain scored at turn 3) and over the
    self-contained kinds (:data:`SELF_KINDS`), 3 decimals; ``per_kind`` every row of every kind
    (``n`` conversations) and ``oracle_ratio``/``without_ratio`` of each follow-up kind."""
    mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
    per = {k: {r: mean(res[k][r]) for r in ROWS} | {"n": len(res[k]["with"])} for k in res}
    for k in FOLLOWUP_KINDS:
        p = per.get(k)
        if p and p["with"] is not None:
            p["oracle_ratio"] = round(p["with"] / p["oracle"], 3) if p["oracle"] else None
            p["without_ratio"] = round(p["with"] / p["without"], 3) if p["without"] else None
    pool = lambda kinds, r: mean([x for k in kinds if k in res for x in res[k][r]])  # noqa: E731
    return {
        "followup_top1_with": pool(FOLLOWUP_KINDS, "with"), "followup_top1_without": pool(FOLLOWUP_KINDS, "without"),
        "followup_top1_oracle": pool(FOLLOWUP_KINDS, "oracle"), "followup_top1_naive": pool(FOLLOWUP_KINDS, "naive"),
        "chain_turn2_top1_with": mean(chain2), "chain_turn3_top1_with": per.get("chain", {}).get("with"),
        "selfcontained_top1_with": pool(SELF_KINDS, "with"), "selfcontained_top1_without": pool(SELF_KINDS, "without"),
        "selfcontained_top1_naive": pool(SELF_KINDS, "naive"), "per_kind": per,
    }


def scifact_wikitext(corpus, out, min_chars: int = 2400, fillers: int = 300) -> int:
    """A second corpus for the sets, in WikiText form: the SciFact abstracts (``corpus.jsonl``,
    ``{"title", "text"}``) of at least ``min_chars`` characters (long enough for three server
    chunks, so they can give conversations), then the first ``fillers`` shorter ones (distractors
    only), in file order, each as `` = title = `` and one paragraph (a title without its final
    dot; a ``=`` in it becomes ``-``). :returns: the number of articles written."""
    import json
    from pathlib import Path

    rows = [json.loads(x) for x in Path(corpus).read_text(encoding="utf-8").splitlines() if x.strip()]
    long = [r for r in rows if len(r["text"]) >= min_chars]
    short = [r for r in rows if len(r["text"]) < min_chars][:fillers]
    lines = []
    for r in long + short:
        title = r["title"].rstrip(".").replace("=", "-").strip()
        lines += ["", f" = {title} = ", "", f" {' '.join(r['text'].split())} ", ""]
    Path(out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(long) + len(short)


if __name__ == "__main__":  # python -m bench.memory_sets --scifact CORPUS OUT
    import sys

    if len(sys.argv) == 4 and sys.argv[1] == "--scifact":
        print(scifact_wikitext(sys.argv[2], sys.argv[3]), "articles written to", sys.argv[3])
    else:
        raise SystemExit("usage: python -m bench.memory_sets --scifact CORPUS.jsonl OUT.txt")
