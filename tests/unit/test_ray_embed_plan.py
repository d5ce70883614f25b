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


class _Ref:
    def __init__(self, fn):
        self.fn = fn

    def future(self):
        import concurrent.futures

        f = concurrent.futures.Future()
        try:
            f.set_result(self.fn())
        except BaseException as exc:  # noqa: BLE001
            f.set_exception(exc)
        return f


class _Actor:
    """Stands in for an actor handle: ``encode.remote(ids)`` -> a ref whose vectors are
    ``[len(ids[i]), i]``, or a lost actor (RayActorError)."""

    def __init__(self, ray, lost: bool):
        self.ray, self.lost, self.encode, self.calls = ray, lost, self, 0

    def remote(self, ids):
        self.calls += 1

        def run():
            if self.lost:
                raise self.ray.exceptions.RayActorError()
            return np.array([[len(x), i] for i, x in enumerate(ids)], dtype=np.float32)

        return _Ref(run)


def _pool(actors):
    from oprag_server.engine.ray_embed import RayEmbedPool

    pool = RayEmbedPool.__new__(RayEmbedPool)  # no Ray cluster: the actor handles are stand-ins
    pool.n, pool.batch_size, pool.metrics, pool.actors, pool.retried = len(actors), 2, None, actors, 0
    return pool


def test_a_lost_actors_part_goes_to_another_and_rows_come_back_in_input_order():
    import asyncio

    ray = pytest.importorskip("ray")
    ids = [[1] * n for n in (3, 9, 1, 7, 5, 2, 8)]
    pool = _pool([_Actor(ray, lost=True), _Actor(ray, lost=False)])
    out = asyncio.run(pool.embed_chunks(ids))
    assert out.dtype == np.float32 and out.flags.writeable
    assert out[:, 0].tolist() == [len(x) for x in ids]
    assert pool.retried >= 1 and pool.actors[1].calls >= 2
    with pytest.raises(RuntimeError, match="every Ray embedding actor failed"):
        asyncio.run(_pool([_Actor(ray, True), _Actor(ray, True)]).embed_chunks(ids))
