"""How :class:`~oprag_server.engine.ray_embed.RayEmbedPool` deals a window of chunks to its
actors: whole encoder batches (the ones ``encode_tokenized`` forms for the whole window, so
padding and vectors are unchanged), balanced by padded tokens."""

from __future__ import annotations

import numpy as np
import pytest

from oprag_server.engine.ray_embed import plan_batches


def _encoder_batches(ids, batch_size):
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_each_worker_gets_whole_encoder_batches_that_its_own_sort_reforms(workers):
    rng = np.random.default_rng(0)
    ids = [[1] * int(n) for n in rng.integers(1, 256, 300)]
    ids += [[1] * 40] * 50  # ties across batch boundaries
    plan = plan_batches(ids, 32, workers)
    assert sorted(i for p in plan for i in p) == list(range(len(ids)))
    whole = {tuple(b) for b in _encoder_batches(ids, 32)}
    for p in plan:
        sub = [ids[i] for i in p]
        # the worker's encoder sorts its part and cuts batches of 32: the same batches as the whole window
        assert {tuple(p[j] for j in b) for b in _encoder_batches(sub, 32)} <= whole


def test_work_is_balanced_by_padded_tokens():
    ids = [[1] * n for n in range(1, 257)] * 4
    plan = plan_batches(ids, 32, 2)
    tokens = [sum(len(ids[i]) for i in p) for p in plan]
    assert abs(tokens[0] - tokens[1]) <= 256 * 32  # at most one batch apart
    assert plan_batches([], 32, 2) == [[], []]
