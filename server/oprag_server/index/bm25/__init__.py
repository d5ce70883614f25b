"""BM25 (Okapi variant of ``rank_bm25`` 0.2.2) over sharded, mutable postings.

Reference implementation: ``rank_bm25.BM25Okapi`` 0.2.2 (``rank_bm25.py``):

* ``BM25._initialize``: ``doc_len[d] = len(document)`` (tokens), ``avgdl = sum(doc_len)
  / corpus_size``, ``nd[term]`` = number of documents containing ``term``.
* ``BM25Okapi._calc_idf``: ``idf(t) = log(N - df + 0.5) - log(df + 0.5)`` (natural log)
  for every corpus term; ``average_idf = sum(idf over all corpus terms, negative ones
  included, before flooring) / number of distinct corpus terms``; every term with
  ``idf < 0`` is then replaced by ``epsilon * average_idf``.  ``idf == 0`` (a term in
  exactly half the documents) is NOT floored.
* ``BM25Okapi.get_scores``: for each query token ``q`` *in query order* (a repeated
  token is counted each time)::

      score += idf(q) * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * doc_len / avgdl)))

  with ``idf(q) = 0`` for tokens that are not in the corpus.  Defaults ``k1=1.5,
  b=0.75, epsilon=0.25``.

This package splits that computation:

* :mod:`.okapi` -- the pure formulas (:func:`okapi_idf`, :func:`okapi_idf_floor`,
  :func:`okapi_term_weight`).
* :mod:`.corpus_stats` -- :class:`CorpusStats`, the frontend's corpus-global view (``N``,
  total length, document frequencies), aggregated over shards, producing
  :meth:`CorpusStats.query_idf` and :attr:`CorpusStats.avgdl`.
* :mod:`.postings` -- :class:`PostingsIndex`, one per shard: an immutable CSR segment
  (:mod:`.segment`: term dictionary, int32 slots and uint16 tf per term) plus a delta of
  recent writes (:mod:`.delta`), deletes as a live mask, merges that fold the delta and drop
  dead postings; document lengths; scores chunks given the global idf vector and avgdl.

With the same corpus, ``PostingsIndex.score`` reproduces ``get_scores`` bit-for-bit in
practice (same operation order; the only difference is ``average_idf`` being summed with
numpy's pairwise summation instead of a sequential Python loop, a ~1e-16 relative
difference that only reaches scores through ``epsilon * average_idf``).

Deliberate deviations (``rank_bm25`` raises or produces NaN there):

* Empty corpus / corpus without any term: ``rank_bm25`` raises ``ZeroDivisionError``
  (``avgdl = 0 / 0`` or ``idf_sum / len(idf) = x / 0``).  Here ``avgdl == 0.0``,
  ``average_idf == 0.0``, every idf is 0 and every score is 0 (``score`` returns zeros,
  ``score_all`` returns empty arrays).
* ``avgdl == 0`` passed to the scoring functions: the result is all zeros / empty
  (a corpus whose chunks are all empty contains no term, so every ``tf`` is 0 anyway);
  no division is performed, so there is no NaN and no warning.
"""

from .corpus_stats import CorpusStats
from .okapi import okapi_idf, okapi_idf_floor, okapi_term_weight
from .postings import PostingsIndex

__all__ = [
    "okapi_idf",
    "okapi_idf_floor",
    "okapi_term_weight",
    "CorpusStats",
    "PostingsIndex",
]
