"""Exact min-max hybrid in one round (``EXACT_MINMAX``, :mod:`oprag_server.index.kernels_band`):
the hits equal a brute-force exact min-max over every eligible chunk (canonical dense scores;
BM25 checked against rank_bm25 0.2.2 ``BM25Okapi``): same ids, fused scores, dense and BM25
scores and reported ranks, with ties broken by chunk id. Two corpus generators (Zipf vocabulary;
duplicated and nearly duplicated chunks), random weights (zeros included), filters and k; the
approximate dense scores are also perturbed within their error bound (BLAS and the flat index's int8
scan, which exact mode reads). Mutants of the band (k - 1, ids ranked the wrong way, the error bound
ignored, the canonical second pass left out) make the same comparison fail."""

from __future__ import annotations

import numpy as np
import pytest
from rank_bm25 import BM25Okapi
from test_retrieval import DIM, VOCAB
from test_retrieval_ops import Corpus

from oprag_server import records
from oprag_server.index import kernels_band, kernels_scan
from oprag_server.index.analyzer import Analyzer
from oprag_server.index.dense import DenseIndex, fixed_order_dot
from oprag_server.index.fusion import fuse_minmax

WORDS = VOCAB + [f"w{i}" for i in range(30)]


def _unit(v):
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def _zipf_corpus(rng) -> Corpus:
    c = Corpus()
    p = 1.0 / np.arange(1, len(WORDS) + 1) ** 1.1
    for i in range(int(rng.integers(20, 60))):
        chunks = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)), p=p / p.sum()).tolist())
                  for _ in range(int(rng.integers(1, 4)))]
        c.put(f"z{i:03d}", chunks, _unit(rng.normal(size=(len(chunks), DIM))), {"g": str(i % 3)})
    return c


def _tied_corpus(rng) -> Corpus:
    """Few distinct texts and vectors, many copies; some vectors one float32 step apart (their
    canonical scores differ by less than the approximate scores' error bound)."""
    c = Corpus()
    texts = [" ".join(rng.choice(VOCAB[:6], size=int(rng.integers(1, 5))).tolist()) for _ in range(5)]
    base = _unit(rng.normal(size=(3, DIM)))
    near = base.copy()
    near[:, 0] = np.nextafter(near[:, 0], np.float32(2), dtype=np.float32)
    vecs = np.concatenate([base, near, np.round(base * 4) / 4])
    for i in range(int(rng.integers(20, 70))):
        n = int(rng.integers(1, 3))
        c.put(f"t{int(rng.integers(0, 10**6)):06d}-{i}", [texts[j] for j in rng.integers(0, len(texts), n)],
              vecs[rng.integers(0, len(vecs), n)], {"g": str(i % 3)})
    return c


def _near_corpus(rng) -> Corpus:
    """One text; each vector is one of two a float32 step apart (closer than the error bound)."""
    c = Corpus()
    base = _unit(rng.normal(size=(1, DIM)))
    near = base.copy()
    j = int(np.argmax(np.abs(base[0])))
    near[0, j] = np.nextafter(near[0, j], np.float32(2 * np.sign(near[0, j])), dtype=np.float32)
    for i in range(int(rng.integers(10, 40))):
        c.put(f"n{int(rng.integers(0, 10**6)):06d}-{i}", ["alpha beta"], near if rng.random() < 0.5 else base,
              {"g": str(i % 3)})
    return c, base[0]


def _reference(c: Corpus, q: str, qv: np.ndarray, spec: dict) -> list[tuple]:
    """Brute force over every chunk: ``(id, fused, dense, lexical, dense rank, lexical rank)``
    of the top-k; BM25 values are the server's, checked against rank_bm25 here."""
    rows = c.rows()
    an = Analyzer()
    ref = BM25Okapi([an.tokens(t) for _, t, _, _ in rows]).get_scores(an.tokens(q))
    got, _ = c.retrieve(q, qv, mode="lexical", top_k=len(rows))
    lex_of = {h.chunk_id: h.lexical_score for h in got}
    lex = np.array([lex_of.get(cid, 0.0) for cid, *_ in rows])
    np.testing.assert_allclose(lex, ref, rtol=0, atol=1e-9)
    want = dict(spec.get("filters", ()))
    ok = [i for i, (_, _, _, m) in enumerate(rows) if all(m.get(key) in vals for key, vals in want.items())]
    if not ok:
        return []
    ids = [rows[i][0] for i in ok]
    qc = records.as_query_matrix(qv[None, :], DIM)[0]
    dense = fixed_order_dot(np.stack([rows[i][2] for i in ok]), qc)
    lex = lex[ok]
    fused = fuse_minmax(dense, lex, dense_range=(dense.min(), dense.max()), lexical_range=(lex.min(), lex.max()),
                        dense_weight=spec["dense_weight"], lexical_weight=spec["lexical_weight"])
    n = spec["candidates"]
    drank = {i: r + 1 for r, i in enumerate(sorted(range(len(ok)), key=lambda i: (-dense[i], ids[i]))[:n])}
    listed = [i for i in range(len(ok)) if lex[i] != 0.0]
    lrank = {i: r + 1 for r, i in enumerate(sorted(listed, key=lambda i: (-lex[i], ids[i]))[:n])}
    top = sorted(range(len(ok)), key=lambda i: (-fused[i], ids[i]))[: spec["top_k"]]
    return [(ids[i], fused[i], dense[i], lex[i], drank.get(i, 0), lrank.get(i, 0)) for i in top]


WEIGHTS = [(0.0, 1.0), (1.0, 0.0), (0.5, 0.5), (0.3, 0.7), None]


def _mismatches(seeds, makers=(_zipf_corpus, _tied_corpus)) -> int:
    """How many (corpus, query) cases differ from the brute force."""
    bad = 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        for make in makers:
            c = make(rng)
            if make is _near_corpus:
                c, v = c
            for _ in range(6):
                q = " ".join(rng.choice(VOCAB[:8] if make is not _zipf_corpus else WORDS[:20],
                                        size=int(rng.integers(1, 4))).tolist())
                qv = _unit(rng.normal(size=DIM)) if make is _zipf_corpus or rng.random() < 0.5 else \
                    _unit(c.rows()[int(rng.integers(0, len(c.rows())))][2].astype(np.float64))
                if make is _near_corpus:  # near the chunks' vector: the two dense scores differ
                    qv = _unit(v + rng.normal(scale=0.1, size=DIM))
                w = WEIGHTS[int(rng.integers(0, len(WEIGHTS)))] or tuple(rng.uniform(0.0, 2.0, 2))
                spec = dict(mode="full_hybrid", top_k=int(rng.integers(1, 16)), candidates=int(rng.integers(1, 40)),
                            dense_weight=float(w[0]), lexical_weight=float(w[1]))
                if rng.random() < 0.4:
                    spec["filters"] = (("g", tuple(sorted({str(x) for x in rng.integers(0, 3, 2)}))),)
                hits, _ = c.retrieve(q, qv, **spec)
                got = [(h.chunk_id, h.score, h.dense_score, h.lexical_score, h.dense_rank, h.lexical_rank)
                       for h in hits]
                bad += got != _reference(c, q, qv, spec)
    return bad


@pytest.fixture
def noise(monkeypatch):
    """Approximate dense scores moved by up to 45% of the error bound (the BLAS error is at
    most half of it), as another summation order may."""
    orig, rng = DenseIndex.score_all, np.random.default_rng(7)

    def score_all(self, queries):
        out = orig(self, queries).astype(np.float64)
        q = records.as_query_matrix(queries, self.dim)
        err = np.array([self.score_error(x) for x in q])[:, None]
        return out + rng.uniform(-0.45, 0.45, out.shape) * err

    monkeypatch.setattr(DenseIndex, "score_all", score_all)


@pytest.mark.parametrize("part", range(3))
def test_one_round_equals_brute_force_exact_minmax(part):
    assert _mismatches(range(4 * part, 4 * part + 4)) == 0


NOISY = dict(seeds=range(100, 106), makers=(_zipf_corpus, _tied_corpus, _near_corpus))


def test_one_round_stays_exact_when_approximate_scores_err(noise):
    assert _mismatches(**NOISY) == 0


@pytest.fixture
def i8_noise(monkeypatch):
    """The flat index's int8 scan scores (what exact mode ranks by) moved by up to 45% of each
    row's error bound, and a count of the scans (exact mode must read them, not a BLAS product)."""
    orig, rng, calls = kernels_scan.Int8Rows.scores, np.random.default_rng(11), []

    def scores(self, q, rows):
        out = orig(self, q, rows)
        calls.append(out.size)
        bound = np.minimum(self.row_scale(q) * self.rb + 1e-12, self.error(q))  # (per row, as exact mode uses)
        bound = bound if rows is None else bound[rows]
        return (out + rng.uniform(-0.45, 0.45, out.shape) * bound).astype(np.float32)

    monkeypatch.setattr(kernels_scan.Int8Rows, "scores", scores)
    return calls


def test_one_round_stays_exact_when_int8_scores_err(i8_noise):
    assert _mismatches(**NOISY) == 0
    assert len(i8_noise) > 0  # (exact mode and the hybrid scan read the int8 copy)


def test_exact_mode_reads_the_int8_copy(i8_noise, monkeypatch):
    def no_blas(self, queries):
        raise AssertionError("full_hybrid over a flat index took the float32 product")

    monkeypatch.setattr(DenseIndex, "score_all", no_blas)
    assert _mismatches(range(2)) == 0
    assert len(i8_noise) > 0


def test_ignoring_the_int8_error_bound_fails(i8_noise, monkeypatch):
    _mutant(monkeypatch, no_err=True)
    assert _mismatches(**NOISY) > 0


def test_leaving_out_the_canonical_second_pass_fails(i8_noise, monkeypatch):
    """The second pass over the first's superset (which only makes the reply smaller) must rank by
    the canonical scores: passing it the approximate ones with margin 0 fails."""
    orig_band = kernels_band.band
    seen = {}

    def band(p1, p2, r, k, e2=0.0, tol=np.inf):
        if e2 > 0.0:
            seen["approx"] = np.asarray(p1, np.float64)
            seen["pos"] = orig_band(p1, p2, r, k, e2, tol)
            return seen["pos"]
        if "pos" in seen and len(p1) == seen["pos"].size:  # the second pass: feed it the approximations
            p1 = seen.pop("approx")[seen.pop("pos")]
        return orig_band(p1, p2, r, k, e2, tol)

    monkeypatch.setattr(kernels_band, "band", band)
    assert _mismatches(**NOISY) > 0


@pytest.mark.parametrize("seed", range(30))
def test_band_of_the_kept_with_exact_scores_equals_the_band_of_all(seed):
    """Exact mode's two passes: the band from approximate scores (within ``err``) keeps a
    superset; the band over those with the exact scores keeps exactly what a band over every
    chunk with the exact scores keeps (the relation is transitive)."""
    rng = np.random.default_rng(1000 + seed)
    n, k = int(rng.integers(1, 3000)), int(rng.integers(1, 20))
    p1 = np.round(rng.normal(size=n), int(rng.integers(1, 4)))
    p2 = np.where(rng.random(n) < rng.uniform(0.0, 0.9), 0.0, np.round(rng.gamma(2.0, size=n), int(rng.integers(0, 3))))
    r = rng.permutation(n)
    tol = [np.inf, 0.0, 0.05][seed % 3]
    err = [1e-3, 1e-2, 0.2][seed % 3]
    approx = p1 + rng.uniform(-err, err, n)
    first = kernels_band.band(approx, p2, r, k, 2.000001 * err + 1e-12, tol)
    second = first[kernels_band.band(p1[first], p2[first], r[first], k, 0.0, tol)]
    assert second.tolist() == kernels_band.band(p1, p2, r, k, 0.0, tol).tolist()


def _mutant(monkeypatch, **how):
    orig = kernels_band.band

    def band(p1, p2, r, k, e2=0.0, tol=np.inf):
        return orig(p1, p2, -np.asarray(r) if how.get("flip") else r, k + how.get("dk", 0),
                    0.0 if how.get("no_err") else e2, tol)

    monkeypatch.setattr(kernels_band, "band", band)


@pytest.mark.parametrize("how", [dict(dk=-1), dict(flip=True)])
def test_mutants_of_the_band_fail(monkeypatch, how):
    _mutant(monkeypatch, **how)
    assert _mismatches(range(4)) > 0


def test_ignoring_the_error_bound_fails(noise, monkeypatch):
    _mutant(monkeypatch, no_err=True)
    assert _mismatches(**NOISY) > 0


def _brute_keep(p1, p2, r, k, tol=np.inf):
    """bool[N]: fewer than k others with p1 >=, p2 >= and a smaller id rank or p2 > by tol."""
    ahead = (p1[None, :] >= p1[:, None]) & (p2[None, :] >= p2[:, None]) & \
        ((r[None, :] < r[:, None]) | (p2[None, :] - p2[:, None] > tol))
    return ahead.sum(axis=1) < k


@pytest.mark.parametrize("seed", range(40))
def test_band_keeps_every_chunk_fewer_than_k_certainly_outrank(seed):
    """The kernel against the O(N^2) definition, with exact and approximate first scores, on
    large ties and on the block + outside split (N above the block size)."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 900) if seed % 4 else rng.integers(1000, 4000)), int(rng.integers(1, 20))
    p1 = np.round(rng.normal(size=n), int(rng.integers(1, 4)))
    p2 = np.where(rng.random(n) < rng.uniform(0.0, 0.9), 0.0, np.round(rng.gamma(2.0, size=n), int(rng.integers(0, 3))))
    r = rng.permutation(n)
    tol = [np.inf, 0.0, 0.05][seed % 3]
    want = _brute_keep(p1, p2, r, k, tol)
    got = np.zeros(n, bool)
    got[kernels_band.band(p1, p2, r, k, 0.0, tol)] = True
    assert not (want & ~got).any()
    assert got.sum() <= want.sum() + 4 * k + 64  # a superset, not much larger
    err = 1e-3
    approx = p1 + rng.uniform(-err, err, n)
    got[:] = False
    got[kernels_band.band(approx, p2, r, k, 2.000001 * err + 1e-12, tol)] = True
    assert not (want & ~got).any()


def _margin_violations(scale: float, n: int = 20000) -> int:
    """Pairs whose BM25 scores differ by more than ``scale`` times :func:`second_margin` (dense
    not lower) and still fuse lower or equal, over random weights (BM25 weight down to 1e-12 of
    the dense one), ranges and scores a few ulps from the margin."""
    rng = np.random.default_rng(3)
    bad = 0
    for _ in range(n):
        wd, wl = rng.uniform(0, 2), rng.uniform(0, 2) * 10.0 ** -rng.integers(0, 13)
        lspan_max = rng.uniform(1, 50)
        llo = rng.uniform(-lspan_max / 4, 0)
        lhi = llo + lspan_max * rng.uniform(0.5, 1.0)
        lp = rng.uniform(llo, lhi)
        lq = min(lhi, lp + scale * kernels_band.second_margin(wd, wl, lspan_max))
        dlo, dhi = np.sort(rng.uniform(-1, 1, 2))
        dp = rng.uniform(dlo, dhi)
        dq = dp if rng.random() < 0.5 else np.nextafter(dp, 2.0)
        f = fuse_minmax(np.array([dp, min(dq, dhi)]), np.array([lp, lq]), dense_range=(dlo, dhi),
                        lexical_range=(llo, lhi), dense_weight=wd, lexical_weight=wl)
        bad += lq > lp and lq - lp > scale * kernels_band.second_margin(wd, wl, lspan_max) and not f[1] > f[0]
    return bad


def test_a_bm25_gap_above_the_margin_fuses_strictly_higher():
    assert _margin_violations(1.0) == 0
    assert _margin_violations(1e-3) > 0  # a thousand times smaller is not enough


@pytest.mark.parametrize("seed", range(20))
def test_refine_top_with_per_element_bounds_equals_the_exact_ranking(seed):
    """``refine_top`` with one bound per element (exact mode over the int8 scan) ranks as a full
    sort of the exact scores (desc, id asc), ties and near-ties included, and scores only a
    shortlist; bounds half as large as the real errors make it fail."""
    from oprag_server.index.fusion import refine_top

    rng = np.random.default_rng(500 + seed)
    m, k = int(rng.integers(1, 2000)), int(rng.integers(1, 300))
    exact = np.round(rng.normal(size=m), int(rng.integers(1, 4)))
    bound = rng.uniform(0.0, 0.05, m) * (rng.random(m) < 0.9)
    approx = exact + rng.uniform(-1.0, 1.0, m) * bound
    ids = [f"c{i:05d}" for i in rng.permutation(m)]
    seen = []
    pos, ex = refine_top(approx, bound, lambda p: (seen.append(p.size), exact[p])[1], ids, k)
    want = sorted(range(m), key=lambda i: (-exact[i], ids[i]))[:k]
    assert pos.tolist() == want and ex.tolist() == exact[want].tolist()
    assert sum(seen) <= m
    if seed < 10:  # too small a bound: the same comparison can fail
        bad = 0
        for s in range(20):
            r = np.random.default_rng(s)
            e = r.normal(size=300)
            b = r.uniform(0.0, 0.5, 300)
            a = e + r.choice([-1.0, 1.0], 300) * b
            p, _ = refine_top(a, b / 2, lambda p: e[p], list(range(300)), 10)
            bad += p.tolist() != sorted(range(300), key=lambda i: (-e[i], i))[:10]
        assert bad > 0
    with pytest.raises(ValueError):
        refine_top(approx, bound, lambda p: exact[p], ids, k, complete=False)
