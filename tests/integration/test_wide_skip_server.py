"""The BM25 list's wide pass with block skipping (index/kernels_wide_keep.py, session 45) on a
real server: 2 shard processes, HNSW, chunks ingested in topic runs (so a block's chunks share
a topic and the block bounds differ), the stop word "the" in every chunk and a marker word in
most of a topic's chunks (a wide term of real weight, whose block bounds decide the skips). A query repeating
"the" 24 times crosses the shards' 65,536-postings threshold of the pruned BM25 paths (repeats
count again, as in rank_bm25), so its BM25 list comes from the wide pass, which starts from the
dense candidates' BM25 and skips blocks. HYBRID (certified) must equal FULL_HYBRID (every chunk
scored) hit for hit, score for score, at several top_k (4 top_k = the BM25 list length per shard;
top_k 50 asks for 200) and lexical weights up to 0.97 (the BM25 list then decides the hits), before
and after a delete / replace round. That the pass does skip
blocks on this corpus is checked in process on the same texts (the server's own kernels)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # (its rule: a unit test in the default suite)

D, N, TOPICS, RUN = 384, 6000, 8, 250


def _corpus(rng):
    centres = rng.standard_normal((TOPICS, D)).astype(np.float32)
    vocab = [[f"t{t}w{j}" for j in range(30)] for t in range(TOPICS)]
    texts, vecs = [], []
    for i in range(N):
        t = (i // RUN) % TOPICS
        words = list(rng.choice(vocab[t], size=int(rng.integers(3, 12))))
        words += ["the"] * int(rng.integers(1, 4 + t % 3)) + ["of"] * int(rng.random() < 0.5)
        words += [f"mark{t}"] * int(rng.integers(0, 6))  # a topic's marker: a wide term of weight ~2, tf 0-5
        words += [f"f{j}" for j in rng.integers(0, 3000, int(rng.integers(16, 28)))]  # rare filler (postings enough
        # for the shards' BM25 merge: the wide pass reads a merged segment)
        rng.shuffle(words)
        texts.append(" ".join(words))
        vecs.append(centres[t] + 0.7 * rng.standard_normal(D).astype(np.float32))
    queries = []
    for q in range(12):  # the words of topic t; the vector of topic t, or of another one for half of them (the BM25
        t = q % TOPICS   # list then brings chunks the dense list does not)
        text = " ".join(["the"] * 24 + [f"mark{t}"] * int(1 + q % 3) + list(rng.choice(vocab[t], size=int(rng.integers(0, 3)))))
        queries.append((text, (centres[(t + 3 * (q % 2)) % TOPICS] + 0.4 * rng.standard_normal(D)).astype(np.float32)))
    return texts, np.asarray(vecs), queries


def _key(r):
    return [(h.chunk_id, h.score, h.dense_score, h.lexical_score) for h in r.hits]


def _skips_in_process(texts, queries) -> int:
    """Blocks the wide pass skips for ``queries`` over one shard's worth of ``texts`` (half),
    with the server's analyzer and kernels: the corpus does exercise the skipping."""
    from oprag_server.index import kernels_wide_keep as kk
    from oprag_server.index.analyzer import Analyzer
    from oprag_server.index.bm25 import listed_top as lt
    from oprag_server.index.bm25 import wide_rows
    from oprag_server.index.bm25.postings import PostingsIndex

    an, ix = Analyzer(), PostingsIndex()
    for s, text in enumerate(texts[: N // 2]):
        ix.add(s, an.tokens(text))
    ix.merge()
    w, seg = wide_rows.WideRows(ix._seg, ix._doc_len), ix._seg  # noqa: SLF001
    avgdl = float(np.asarray(ix._doc_len).mean())  # noqa: SLF001
    skipped = 0
    for text, _ in queries:
        terms = an.tokens(text)
        idf = np.array([max(np.log((len(ix) - ix.df(t) + 0.5) / (ix.df(t) + 0.5)), 0.3) for t in terms])
        tids, d_off, ds, dt = lt._query_arrays(ix, terms)  # noqa: SLF001
        is_wide, row, n_wide = w.positions(tids)
        assert lt._postings(seg, tids) >= lt._FULL_BELOW and n_wide * lt._WIDE_GAIN >= w.span  # noqa: SLF001
        cap = ix._doc_len.size  # noqa: SLF001
        mx = kk.wide_pass(ix._where, lt._SEG, ix._doc_len, w.seg_len, tids, idf, seg.offsets, seg.slots, seg.tf,  # noqa: SLF001
                          d_off, ds, dt, is_wide, row, w.rows, w.span, 40, avgdl, 1.5, 0.75, np.zeros(cap, np.float32),
                          np.zeros(cap, np.uint8), w.bmax, w.bratio, 0.0)[3]
        skipped += int((mx[1] > mx[0]).sum())
    return skipped


def test_hybrid_with_the_skipping_wide_pass_equals_full_hybrid(tmp_path):
    rng = np.random.default_rng(45)
    texts, vecs, queries = _corpus(rng)
    assert _skips_in_process(texts, queries) > 0
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2", "--dense-index", "hnsw").start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest([Doc(f"d{i:05d}", texts[i], vector=vecs[i]) for i in range(N)])

            def merged():  # the chunks in each shard's segment (the wide rows are the segment's): a shard merges
                time.sleep(6)  # its BM25 delta once it holds 65,536 postings or writes are quiet for 5 s (README)
                return wait_until(lambda: all(s.merge_pending == 0 and s.ann_pending == 0 for s in c.stats().shards),
                                  timeout=90, interval=0.5)

            def compare():
                for (text, q), (k, w) in itertools.product(queries, ((10, 0.5), (25, 0.5), (50, 0.5), (10, 0.9), (25, 0.97))):
                    kw = dict(top_k=k, query_vector=q.tolist(), dense_weight=1.0 - w, lexical_weight=w)
                    hy, ex = c.retrieve(text, **kw), c.retrieve(text, mode="full_hybrid", **kw)
                    assert hy.retrieval.certified, (text, k, w)
                    assert _key(hy) == _key(ex), (text, k, w)
                    assert any(h.lexical_score > 0 for h in hy.hits)

            assert merged()
            compare()
            gone = [f"d{i:05d}" for i in rng.choice(N, 300, replace=False)]
            c.delete(gone)
            again = [int(i) for i in rng.choice(N, 300, replace=False)]
            c.ingest([Doc(f"d{i:05d}", texts[(i + 7) % N], vector=vecs[(i + 7) % N]) for i in again])
            compare()  # deletes and replacements in the delta layers
            assert merged()
            compare()  # folded into new segments
    finally:
        srv.stop()
