"""The ``memory`` operator: per-session state reached through the shard path.

Records of a session live on the shard its session id routes to (the same stable hash as
documents). *Lookup* runs before embedding, for all sessions of a scheduler batch in one call
per shard, and builds the *session context* of each question: the question followed by the
resolved subject of the session's recent turns (newest first, a turn ``a`` turns old weighted
``decay ** a``; subjects under ``min_weight`` are left out) and its dense vector, the question's
plus the same turns' stored vectors (:func:`context_vector`; no second encoder row). The query
is then retrieved twice in the same shard calls -- the question alone and the session context,
one extra row -- and the two ranked lists are fused by reciprocal rank (:func:`fuse_lists`): a chunk both
lists rank high wins, so a follow-up whose subject is implicit gains from the context row while
a question that names its own subject keeps the chunks its own list ranks first. When the
fusion changed the ranking, the chunks of its top document are put in the order of the
question's own terms (:func:`passage_order`): the session finds the subject, the question the
passage. With ``cfg.condense`` and an engine generator, one short generation rewrites the
follow-up into a standalone question that replaces the session context (:meth:`Memory.condense`).

*Promotion* after an answer writes a compact record through the shard's promote op: the
question, the retrieval text it resolved to, an answer summary, and its *subject* -- the
documents and titles of its top sources, and (for untitled sources) the salient terms: terms of
the resolved query found in the top source but not in the best source of another document. A
chain of follow-ups therefore keeps its subject. No word list takes part in any decision.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time

import numpy as np

from ..config import MemoryConfig
from ..domain import Hit, MemoryContext
from ..index.analyzer import Analyzer
from ..shards.pool import ShardPool
from ..shards.protocol import MemoryClearRequest, MemoryLookupRequest, MemoryTurn, Op, PromoteRequest

DECAY = 0.5  # weight of a turn relative to the next newer one
MIN_WEIGHT = 0.5  # subjects of turns weighted below this are not added to the context
RRF_K = 10  # reciprocal-rank constant of the list fusion (small: the heads of the lists decide)
MEMORY_WINDOW = 20  # depth of each of the two fused lists (at least the request's top_k)
SUBJECT_TERMS = 3  # salient terms kept for an untitled subject
TOKEN_CACHE = 4096  # analysed texts kept across requests per analyzer (LRU)

log = logging.getLogger(__name__)


def summarise(answer: str, limit: int) -> str:
    """First sentence(s) of the answer, at most ``limit`` characters (deterministic)."""
    a = " ".join(answer.split())
    if len(a) <= limit:
        return a
    cut = a[:limit]
    dot = cut.rfind(". ")
    return cut[: dot + 1] if dot > limit // 3 else cut


def subject_text(turn: MemoryTurn) -> str:
    """What a turn was about: its top source's title, else its salient terms, else its question."""
    titles = [t for t in turn.titles if t]
    if turn.titles and turn.titles[0]:
        return turn.titles[0]
    return " ".join(turn.terms) or (titles[0] if titles else turn.question)


def context_text(question: str, turns: list[MemoryTurn], decay: float = DECAY, min_weight: float = MIN_WEIGHT) -> str:
    """The session context of ``question`` given its session's turns (newest first): the
    question, then each distinct subject of a turn whose weight ``decay ** age`` is at least
    ``min_weight``."""
    subjects: list[str] = []
    for age, t in enumerate(turns):
        if decay ** age < min_weight:
            break
        s = subject_text(t)
        if s and s not in subjects:
            subjects.append(s)
    return f"{question} {' '.join(subjects)}" if subjects else ""


def session_vector(turns: list[MemoryTurn], decay: float = DECAY, min_weight: float = MIN_WEIGHT) -> np.ndarray | None:
    """The session's side of the context row's dense vector, from the stored vectors of the
    same turns :func:`context_text` takes subjects from (newest first, weight ``decay ** age``
    at least ``min_weight``): ``sum(w_a * v_a)``, L2-normalised; float32 ``[D]``, or None when
    a turn in that window has no vector (a record written before vectors were returned).
    Each stored vector is what its turn was retrieved with (its context row when memory changed
    its retrieval), so a chain carries its subject. Used by :func:`context_vector`."""
    vecs = []
    for age, t in enumerate(turns):
        w = decay ** age
        if w < min_weight:
            break
        if t.vector is None or not np.size(t.vector):
            return None
        vecs.append(w * np.asarray(t.vector, dtype=np.float32).reshape(-1))
    if not vecs:
        return None
    v = np.sum(vecs, axis=0)
    n = float(np.linalg.norm(v))
    return (v / n).astype(np.float32) if n > 0 else None


def context_vector(question_vector: np.ndarray, session: np.ndarray) -> np.ndarray:
    """The dense vector of the session-context row without a second encoder row: the
    question's unit vector plus the session's (:func:`session_vector`), L2-normalised (float32
    ``[D]``): halfway between the two on the unit sphere, the vector-space counterpart of the
    context text "question + subject" (whose lexical row still uses that text). Saves the
    encoder the second row, the whole of memory's extra embedding cost."""
    v = np.asarray(question_vector, dtype=np.float32).reshape(-1) + session
    n = float(np.linalg.norm(v))
    return (v / n).astype(np.float32) if n > 0 else np.asarray(question_vector, dtype=np.float32)


def row_weights(own: list[Hit], ctx: list[Hit]) -> tuple[float, float]:
    """Weights of the question's list and of the session-context list in the fusion: each row's
    evidence is the dense score (cosine of L2-normalised vectors, one embedding space for both
    rows, so the two are comparable) of its own top hit, floored at 0; the row with more
    evidence weighs 1, the other ``its evidence / the larger``. A question with no retrieval
    evidence of its own ("Tell me more about it.": cosine ~0.1 to every chunk) so defers to its
    session, one that finds its subject alone keeps it. ``(1.0, 1.0)`` when neither has any."""
    e_own = max(own[0].dense_score, 0.0) if own else 0.0
    e_ctx = max(ctx[0].dense_score, 0.0) if ctx else 0.0
    m = max(e_own, e_ctx)
    return (e_own / m, e_ctx / m) if m > 0 else (1.0, 1.0)


def fuse_lists(own: list[Hit], ctx: list[Hit], top_k: int, rrf_k: float = RRF_K,
               question: str = "", names=None, corpus_idf=None, cache: int = TOKEN_CACHE) -> list[Hit]:
    """The question's own list when both lists' top hits are of the same document (the
    question's subject agrees with the session's, or it names its own and the context does not
    override it) or when the question contains every analysed term of its own top hit's title
    (``names``: the analyzer's ``tokens``; it names its subject); else weighted reciprocal-rank
    fusion of the two lists (Cormack et al. 2009, weights :func:`row_weights`) combined by
    maximum, not sum (CombMAX, Fox & Shaw 1994): ``score = max(w_own / (rrf_k + rank_own),
    w_ctx / (rrf_k + rank_ctx))``, 1-based ranks, a list a chunk is absent from gives 0. Not the
    sum: the context row's text *contains the question*, so a chunk that the question's own words
    match (filler words of a long question too) is in both lists for the same reason, and a sum
    counted those words twice -- it outranked the session's subject although the context row had
    more evidence (bench/RESULTS.md, fourth pass). Ties by the better own rank, then chunk id; with ``names``
    the top document's passages are then ordered by the question (:func:`passage_order`, with
    ``corpus_idf``). Analysed texts are kept across calls (``cache``: :func:`_memo_text_tokens`). The
    returned hits carry the fused score in ``score``; at most ``top_k``."""
    if own and ctx and own[0].doc_id == ctx[0].doc_id:
        return own[:top_k]  # both rows agree on the subject: the question's own ranking stands
    if names:  # each candidate's text analysed once (and kept), for subject_support and passage_order
        names = _memo_text_tokens(names, cache)
    if own and names and own[0].title and set(names(own[0].title)) <= set(names(question)):
        return own[:top_k]  # the question names the title of its own top document: its subject
    weights = row_weights(own, ctx)
    if own and ctx and names and subject_support(own, ctx, question, names, corpus_idf):
        weights = (0.0, 1.0)  # the session's subject explains the question as well as its own top hit
    score: dict[str, float] = {}
    best: dict[str, Hit] = {}
    own_rank = {h.chunk_id: r for r, h in enumerate(own, 1)}
    for w, hits in zip(weights, (own, ctx)):
        for r, h in enumerate(hits, 1):
            score[h.chunk_id] = max(score.get(h.chunk_id, 0.0), w / (rrf_k + r))
            best.setdefault(h.chunk_id, h)
    order = sorted(score, key=lambda c: (-score[c], own_rank.get(c, len(own) + 1), c))
    fused = [dataclasses.replace(best[c], score=score[c]) for c in order]
    return (passage_order(fused, question, names, corpus_idf) if names else fused)[:top_k]


_token_caches: dict = {}  # an analyzer's bound ``tokens`` -> OrderedDict text -> frozenset


def _memo_text_tokens(names, size: int = TOKEN_CACHE):
    """``names`` with each text's token set kept across requests in an LRU of ``size`` texts per
    analyzer, keyed by the text (an edited chunk is analysed again); ``size`` 0: no cache."""
    if size <= 0:
        return lambda text: frozenset(names(text))
    memo = _token_caches.get(names)
    if memo is None:
        _token_caches.clear() if len(_token_caches) >= 8 else None  # analyzers come and go in tests
        memo = _token_caches[names] = collections.OrderedDict()

    def tokens(text: str) -> frozenset:
        got = memo.get(text)
        if got is None:
            got = memo[text] = frozenset(names(text))
            if len(memo) > size:
                memo.popitem(last=False)
        else:
            memo.move_to_end(text)
        return got

    return tokens


def subject_support(own: list[Hit], ctx: list[Hit], question: str, names, corpus_idf=None) -> bool:
    """Whether the session's subject (the document of the context list's top hit) has a
    candidate passage that covers at least as much of the question's term weight as the
    question's own top hit does. Each analysed term of the question weighs as in
    :func:`passage_order` (its idf over both lists' candidates, times the corpus BM25 idf with
    ``corpus_idf``), so a word common in the corpus or among the candidates counts little; a
    passage covers the terms its title or text has. Then what the question's words match in its
    own top hit the subject matches as well, and nothing in the question points away from the
    session; a question that names another subject (a term its own top hit has and the
    subject's passages lack) keeps its own ranking."""
    pool = list({h.chunk_id: h for h in [*own, *ctx]}.values())
    terms = set(names(question))
    has = [(set(names(h.text)) | set(names(h.title or ""))) & terms for h in pool]
    n = len(pool)
    idf = {t: math.log((n + 1) / (sum(t in x for x in has) + 0.5)) for t in terms}
    if corpus_idf is not None and terms:
        order = sorted(terms)
        idf = {t: idf[t] * float(g) for t, g in zip(order, corpus_idf(order))}
    cover = {h.chunk_id: sum(idf[t] for t in x) for h, x in zip(pool, has)}
    subj = max(cover[h.chunk_id] for h in pool if h.doc_id == ctx[0].doc_id)
    return subj > 0 and subj >= cover[own[0].chunk_id]


def passage_order(fused: list[Hit], question: str, names, corpus_idf=None) -> list[Hit]:
    """The fused list with the chunks of its top document reordered by the question's own terms:
    the fusion decides the subject, the question decides the passage. Each analysed term ``t``
    of the question that is not a term of the document's title weighs ``log((n + 1) / (df_t +
    0.5))`` over the whole fused list (both rows' candidates, ``n`` chunks; ``df_t`` those whose
    text has it: a BM25-style idf over the candidate pool, so a word that pulled the question's
    own list to many documents, or that every passage of the subject has, counts little); a
    chunk of the top document scores the sum over the terms it contains; ties keep the fused order.
    With ``corpus_idf`` (terms -> the corpus BM25 idf of each, ``CorpusStats.query_idf``) a term
    weighs the product of the two idfs, the query-side weight from the candidates and the
    document-side weight from the corpus, as the tf-idf dot product weighs a shared term by
    ``idf ** 2`` (Salton & Buckley 1988): a filler word of a long question ("part", "find") is
    common in the corpus though rare among the candidates, and no longer outweighs the rare word
    the question asks about (with the server's 256-token chunks, family 2's long pronoun
    question lost the passage to filler words: bench/RESULTS.md, third pass). The chunks keep
    the positions the document held; other documents' hits do not move. Needed because the
    session-context row is dominated by the subject's name: it finds the right document but
    ranks its passages mostly by that name, not by the detail the follow-up asks about."""
    if not fused:
        return fused
    doc = fused[0].doc_id
    pos = [i for i, h in enumerate(fused) if h.doc_id == doc]
    sub = [fused[i] for i in pos]
    terms = set(names(question)) - set(names(sub[0].title or ""))
    has = [set(names(h.text)) & terms for h in fused]
    n = len(fused)
    idf = {t: math.log((n + 1) / (sum(t in x for x in has) + 0.5)) for t in terms}
    if corpus_idf is not None and terms:
        order = sorted(terms)
        idf = {t: idf[t] * float(g) for t, g in zip(order, corpus_idf(order))}
    rank = sorted(range(len(sub)), key=lambda i: (-sum(idf[t] for t in has[pos[i]]), i))
    out = list(fused)
    for p, i in zip(pos, rank):
        out[p] = sub[i]
    return out


def session_rows(jobs: list) -> tuple[list, np.ndarray, list[str], list]:
    """The retrieval rows of a batch of requests (objects with ``spec``, ``vector``,
    ``context_vector``, ``question``, ``memory``): one per request (its question), then one per
    chunk-level request with a session context (the context text and vector). A request with a
    context row is searched :data:`MEMORY_WINDOW` deep in both rows (the depth of the fused lists).
    :returns: ``(ctx, vecs, texts, specs)``: the requests with a context row, float32
        ``[len(jobs) + len(ctx), D]``, the texts and the specs of the rows."""
    if len(jobs) == 1 and jobs[0].context_vector is None:  # one row: a view (the retriever copies what it sends)
        return [], np.asarray(jobs[0].vector, dtype=np.float32)[None], [jobs[0].question], [jobs[0].spec]
    ctx = [j for j in jobs if j.context_vector is not None and not j.spec.group_by_document]
    deep = {id(j) for j in ctx}

    def widened(spec):
        return dataclasses.replace(spec, top_k=max(spec.top_k, MEMORY_WINDOW))

    specs = [widened(j.spec) if id(j) in deep else j.spec for j in jobs] + [widened(j.spec) for j in ctx]
    vecs = np.stack([j.vector for j in jobs] + [j.context_vector for j in ctx]).astype(np.float32, copy=False)
    return ctx, vecs, [j.question for j in jobs] + [j.memory.context_text for j in ctx], specs


def fuse_session(own: list[Hit], ctx: list[Hit], top_k: int, memory: MemoryContext, question: str,
                 names=None, corpus_idf=None) -> list[Hit]:
    """The hits of a request searched with a session-context row: :func:`fuse_lists` of its two
    lists; sets ``memory.used`` when the result differs from the question's own top ``top_k``
    (then the fused list is returned, else the question's own)."""
    top = own[:top_k]
    fused = fuse_lists(own, ctx, top_k, question=question, names=names, corpus_idf=corpus_idf)
    memory.used = [x.chunk_id for x in fused] != [x.chunk_id for x in top]
    return fused if memory.used else top


def salient_terms(analyzer: Analyzer, resolved: str, hits: list[Hit], n: int = SUBJECT_TERMS) -> list[str]:
    """Terms of ``resolved`` that occur in the top hit's text but not in the best hit of any
    other document (what singles out the subject), in query order, at most ``n``."""
    if not hits:
        return []
    top = set(analyzer.tokens(hits[0].text))
    other = next((h for h in hits[1:] if h.doc_id != hits[0].doc_id), None)
    rest = set(analyzer.tokens(other.text)) if other is not None else set()
    return list(dict.fromkeys(t for t in analyzer.tokens(resolved) if t in top and t not in rest))[:n]


CONDENSE_SYSTEM = ("Rewrite the follow-up question as one standalone question that names its subject, using the "
                   "conversation. Reply with the question only.")


def condense_messages(question: str, turns: list[MemoryTurn]) -> list[dict[str, str]]:
    """Chat messages of the condense-question step (the "condense question" prompt of
    conversational RAG stacks, e.g. LlamaIndex's CondenseQuestionChatEngine): the session's
    turns oldest first, each with its subject (:func:`subject_text`), then the follow-up."""
    hist = "\n".join(f"User: {t.question} (about: {subject_text(t)})" for t in reversed(turns))
    return [{"role": "system", "content": CONDENSE_SYSTEM},
            {"role": "user", "content": f"Conversation:\n{hist}\nFollow-up question: {question}\nStandalone question:"}]


def condensed_text(text: str, limit: int = 400) -> str:
    """The first non-empty line of a condense generation, without quotes or a ``Standalone
    question:`` echo, at most ``limit`` characters ("" when nothing is left)."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    if ":" in line and line.split(":", 1)[0].strip().lower().startswith("standalone"):
        line = line.split(":", 1)[1].strip()
    return line.strip("\"'` ")[:limit]


class Memory:
    def __init__(self, pool: ShardPool, cfg: MemoryConfig, analyzer: Analyzer | None = None,
                 rewriter=None, on_write=lambda: None) -> None:
        """``rewriter``: an engine generator (``is_engine``, :class:`~oprag_server.models.protocols`
        ``stream``/``chat_messages``) that condenses follow-ups (``cfg.condense``), or None.
        ``on_write()``: called after each memory write a shard applied (Runtime: ``mark_dirty``).

        :raises ValueError: ``rewriter`` is not an engine."""
        if rewriter is not None and not getattr(rewriter, "is_engine", False):
            raise ValueError("--memory-condense needs an engine generator (--generator openai or transformers-serve)")
        self.pool, self.cfg, self.on_write = pool, cfg, on_write
        self.analyzer, self.rewriter = analyzer or Analyzer(), rewriter

    async def lookup(self, questions: list[str], session_ids: list[str]) -> list[MemoryContext]:
        """The session context of a batch of questions from their sessions' recent turns.

        ``session_ids[i] == ""`` means no memory for query i. One shard call per shard; a
        shard that is down is left out (its sessions are answered without memory)."""
        out = [MemoryContext(q, "", 0) for q in questions]
        asking = [i for i, sid in enumerate(session_ids) if sid]
        got, _ = await self.pool.scatter(
            Op.MEMORY_LOOKUP, asking, lambda i: self.pool.owner(session_ids[i]),
            lambda idx: MemoryLookupRequest([session_ids[i] for i in idx], self.cfg.lookup_turns, self.cfg.ttl_s))
        found = [(asking[p], turns) for pos, rep in got.values() for p, turns in zip(pos, rep.turns) if turns]
        for i, turns in found:
            out[i] = self._context(questions[i], turns)
            if self.cfg.encode_context:
                out[i].session_vector = None  # the context text gets its own encoder row
        if self.rewriter is not None and found:
            rewritten = await asyncio.gather(*[self.condense(questions[i], turns) for i, turns in found])
            for (i, _), text in zip(found, rewritten):
                if text:
                    out[i].context_text = text
                    out[i].session_vector = None  # the rewrite is embedded as a text
        return out

    async def condense(self, question: str, turns: list[MemoryTurn]) -> str:
        """One short greedy generation (``cfg.condense_tokens``) that rewrites ``question`` into
        a standalone question from its session's ``turns`` (:func:`condense_messages`); "" when
        the engine fails or takes longer than ``cfg.condense_timeout_s`` (the follow-up keeps
        the default session context)."""
        from ..models.protocols import EngineUsage

        parts: list[str] = []
        try:
            async with asyncio.timeout(self.cfg.condense_timeout_s):
                async for delta in self.rewriter.stream(condense_messages(question, turns), self.cfg.condense_tokens,
                                                        EngineUsage()):
                    parts.append(delta)
        except Exception as exc:  # noqa: BLE001 - best effort: the default context stands
            log.warning("condense-question step failed (%s: %s); default session context used", type(exc).__name__, exc)
            return ""
        return condensed_text("".join(parts))

    @staticmethod
    def _context(question: str, turns: list[MemoryTurn]) -> MemoryContext:
        """The memory context of one question given its session's turns (newest first)."""
        last = turns[0]
        titles = list(dict.fromkeys(t for t in last.titles if t))[:2]
        memory_text = f"Previous question: {last.question}"
        if titles:
            memory_text += f" (sources: {'; '.join(titles)})"
        return MemoryContext(question, memory_text, len(turns), context_text=context_text(question, turns),
                             session_vector=session_vector(turns))

    async def promote(self, session_id: str, question: str, answer: str, hits: list[Hit], vector: np.ndarray,
                      resolved: str = "", started: float = 0.0) -> None:
        """Write one turn record to the session's shard (bounded by ``max_turns_per_session``):
        the question, what it resolved to (``resolved``, default the question) and its subject
        from the ranked ``hits`` it was answered with; dropped when the session was cleared after ``started`` (time.time() s)."""
        resolved = resolved or question
        req = PromoteRequest(session_id=session_id, question=question, summary=summarise(answer, self.cfg.summary_chars),
                             chunk_ids=[h.chunk_id for h in hits], titles=[h.title for h in hits], vector=np.asarray(vector, dtype=np.float32).reshape(-1),
                             max_turns=self.cfg.max_turns_per_session, max_total=self.cfg.max_records_total,
                             ttl_s=self.cfg.ttl_s, resolved=resolved, doc_ids=list(dict.fromkeys(h.doc_id for h in hits)),
                             terms=salient_terms(self.analyzer, resolved, hits), started=float(started))
        await self.pool.call(self.pool.owner(session_id), Op.PROMOTE, req)
        self.on_write()  # in the shard's write-ahead log: for the snapshot loop

    async def clear(self, session_id: str) -> int:
        """Drop a session's records; turns of requests that arrived before are not recorded. :returns: records removed."""
        res = await self.pool.call(self.pool.owner(session_id), Op.MEMORY_CLEAR, MemoryClearRequest(session_id, time.time()))
        self.on_write()
        return int(res.removed)
