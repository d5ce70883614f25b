"""The Okapi BM25 formulas of ``rank_bm25`` 0.2.2, element-wise over numpy arrays.

See :mod:`oprag_server.index.bm25` for the reference computation they reproduce.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def okapi_idf(n_docs: int, df: np.ndarray) -> np.ndarray:
    """Okapi idf ``log(N - df + 0.5) - log(df + 0.5)`` (natural log), element-wise.

    Source: ``rank_bm25.BM25Okapi._calc_idf`` (0.2.2), before the epsilon floor.

    Args:
        n_docs: ``N``, number of documents in the corpus (>= 0).
        df: document frequencies, any integer or float array-like of shape ``[T]``,
            each in ``[0, n_docs]``.

    Returns:
        ``np.ndarray`` float64 ``[T]``.  Negative when ``df > N/2``, 0 when
        ``df == N/2``.

    Raises:
        ValueError: ``n_docs < 0`` or some ``df`` outside ``[0, n_docs]``.
    """
    d = np.asarray(df, dtype=np.float64)
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    if d.size and (d.min() < 0 or d.max() > n_docs):
        raise ValueError("df values must lie in [0, n_docs]")
    return np.log(n_docs - d + 0.5) - np.log(d + 0.5)


def okapi_idf_floor(idf: np.ndarray, average_idf: float, epsilon: float) -> np.ndarray:
    """Epsilon floor: ``idf < 0`` -> ``epsilon * average_idf``; other values unchanged.

    Source: ``rank_bm25.BM25Okapi._calc_idf`` (0.2.2).  Note the floor can itself be
    negative when ``average_idf < 0`` (e.g. a corpus where every term is in every doc).

    Args:
        idf: float64 ``[T]`` raw idf values.
        average_idf: mean raw idf over all distinct corpus terms.
        epsilon: floor factor (rank_bm25 default 0.25).

    Returns:
        float64 ``[T]`` (a new array).
    """
    idf = np.asarray(idf, dtype=np.float64)
    return np.where(idf < 0, epsilon * average_idf, idf)


def okapi_term_weight(
    tf: np.ndarray, doc_len: np.ndarray, avgdl: float, k1: float, b: float
) -> np.ndarray:
    """BM25 saturation ``tf*(k1+1) / (tf + k1*(1 - b + b*doc_len/avgdl))`` element-wise.

    Source: ``rank_bm25.BM25Okapi.get_scores`` (0.2.2), same operation order (so the
    values are bit-identical to rank_bm25's).  The score contribution of one query term
    is ``idf * okapi_term_weight(...)``.

    Args:
        tf: term frequency in each document, float64/int ``[M]`` (>= 0).
        doc_len: document length in tokens, float64/int ``[M]``.
        avgdl: average document length in tokens (> 0).
        k1, b: BM25 parameters (rank_bm25 defaults 1.5, 0.75).

    Returns:
        float64 ``[M]``; 0 where ``tf == 0``.

    Raises:
        ValueError: ``avgdl <= 0`` or not finite (rank_bm25 would produce NaN/inf).
    """
    if not (avgdl > 0 and math.isfinite(avgdl)):
        raise ValueError(f"avgdl must be a finite positive number, got {avgdl}")
    tf = np.asarray(tf, dtype=np.float64)
    doc_len = np.asarray(doc_len, dtype=np.float64)
    return tf * (k1 + 1) / (tf + k1 * (1 - b + b * doc_len / avgdl))


def check_avgdl(avgdl: float) -> bool:
    """True if scoring should proceed, False if ``avgdl == 0`` (all scores 0).

    Raises:
        ValueError: ``avgdl`` negative, NaN or infinite.
    """
    avgdl = float(avgdl)
    if avgdl == 0.0:
        return False
    if not (avgdl > 0 and math.isfinite(avgdl)):
        raise ValueError(f"avgdl must be finite and >= 0, got {avgdl}")
    return True



def check_query(terms: Sequence[str], idf: np.ndarray) -> np.ndarray:
    """``idf`` as float64 ``[T]``. :raises ValueError: its shape is not ``[len(terms)]``."""
    idf = np.asarray(idf, dtype=np.float64)
    if idf.ndim != 1 or len(idf) != len(terms):
        raise ValueError(f"idf must have shape [{len(terms)}], got {idf.shape}")
    return idf


def check_slots(slots: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``slots`` as int64. :raises TypeError: not integers. :raises KeyError: some slot is not
    live (``live`` bool ``[capacity]``)."""
    s = np.asarray(slots)
    if s.size == 0:
        return s.astype(np.int64, copy=False)
    if s.dtype.kind not in "iu":
        raise TypeError(f"slots must be an integer array, got dtype {s.dtype}")
    s = s.astype(np.int64, copy=False)
    bad = (s < 0) | (s >= live.size)
    if not bad.any():
        bad = ~live[s]
    if bad.any():
        raise KeyError(f"slot {int(s[np.argmax(bad)])} is not live")
    return s


def as_slot(slot: int) -> int:
    """``slot`` as a Python int. :raises TypeError: not an integer (bools are refused)."""
    if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    return int(slot)
