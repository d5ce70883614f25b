"""Ingest embedding over Ray embedding actors: 1 actor vs 2, on a real multi-node Ray cluster
(``ray.cluster_utils.Cluster``: a zero-CPU head, the frontend's node, and one-CPU worker nodes,
one actor per node), run from ``python -m bench.cluster --embed-only``.

The input is what OpRAG's ingest transform stage produces for the bench corpus (SciFact +
WikiText-2, :func:`bench.ingest.oprag_token_ids`: the server's chunker and MiniLM token ids);
the calls are the ones the ingest embed stage makes (``embed_chunks`` on windows of 1,024
chunks, one window after the other, :class:`~oprag_server.engine.ray_embed.RayEmbedPool`).

Per setting: chunks/s over the windows (wall), and per actor its CPU seconds and busy seconds
(inside ``encode``) over the run, so ``cpu_share`` = CPU s / wall s. Two one-CPU nodes on this
2-vCPU machine compete with the frontend and each other, so the 2-actor wall rate cannot show
the speed-up of a second machine; it is projected instead (:func:`project`) from the measured
per-actor rate per CPU second and the coordination overhead (wall minus the slowest actor's
busy time per window).
"""

from __future__ import annotations

import asyncio
import time

WINDOW = 1024  # chunks per embed_chunks call: the ingest embed stage's window (embed_batch x 32)


def token_ids(n_chunks: int, shared=None, seed: int = 0) -> list[list[int]]:
    """The first ``n_chunks`` chunks (MiniLM token ids) of the bench corpus (under ``shared``,
    default ``bench._common.DEFAULT_SHARED``) in a fixed document order (``seed``)."""
    from ._common import DEFAULT_SHARED, load_corpus
    from .ingest import oprag_token_ids, select_docs

    docs = select_docs(load_corpus(shared or DEFAULT_SHARED), 4000, seed)
    ids: list[list[int]] = []
    for i in range(0, len(docs), 200):
        ids += oprag_token_ids(docs[i : i + 200])[0]
        if len(ids) >= n_chunks:
            break
    return ids[:n_chunks]


async def _run(pool, ids: list[list[int]]) -> dict:
    """Embed ``ids`` window by window; per window the wall time of the ``embed_chunks`` call and
    its overhead (wall minus the busiest actor's time inside ``encode``)."""
    loop = asyncio.get_running_loop()
    await pool.embed_chunks(ids[:64])  # each actor's first forward pass is slower
    before = u0 = await loop.run_in_executor(None, pool.usage)
    embed_s, overhead = 0.0, []
    for w in range(0, len(ids), WINDOW):
        t = time.perf_counter()
        await pool.embed_chunks(ids[w : w + WINDOW])
        dt = time.perf_counter() - t
        u1 = await loop.run_in_executor(None, pool.usage)  # (between calls: not in the timed part)
        embed_s += dt
        overhead.append(dt - max(b["busy_s"] - a["busy_s"] for a, b in zip(u0, u1)))
        u0 = u1
    actors = []
    for a, b in zip(before, u0):
        cpu, busy, n = b["cpu_s"] - a["cpu_s"], b["busy_s"] - a["busy_s"], b["chunks"] - a["chunks"]
        actors.append({"node": b["node"][:8], "chunks": n, "cpu_s": round(cpu, 2), "busy_s": round(busy, 2),
                       "cpu_share": round(cpu / embed_s, 2), "chunks_per_cpu_s": round(n / cpu, 1) if cpu else None})
    return {"actors": actors, "overhead_s": [round(x, 3) for x in overhead], "embed_wall_s": round(embed_s, 2),
            "chunks_per_s": round(len(ids) / embed_s, 1), "nodes_distinct": len({a["node"] for a in actors}) == len(actors)}


def measure(n_chunks: int = 4096, settings=(1, 2), shared=None) -> dict:
    """Start a cluster of ``max(settings)`` one-CPU worker nodes and a zero-CPU head, then for
    each number of actors embed the same chunks through a :class:`RayEmbedPool`; see the module
    doc. :returns: per setting ``{"chunks_per_s", "embed_wall_s", "actors": [...], "overhead_s"}`` and
    ``project``'s figures."""
    import ray

    from . import _internals
    from .cluster import start_cluster

    ids = token_ids(n_chunks, shared)
    path = _internals.encoder_path("minilm")
    cluster = start_cluster(workers=max(settings))
    out: dict = {"chunks": len(ids), "window": WINDOW, "tokens": sum(map(len, ids))}
    try:
        for n in settings:
            pool = _internals.shard_plane().RayEmbedPool(path, {"device": "cpu", "max_tokens": 256}, n=n, cpus=1.0)
            pool.ready()
            out[f"actors_{n}"] = asyncio.run(_run(pool, ids))
            pool.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    if "actors_1" in out and "actors_2" in out:
        out["ratio_2_vs_1"] = round(out["actors_2"]["chunks_per_s"] / out["actors_1"]["chunks_per_s"], 2)
        out["projection"] = project(out, len(ids))
    return out


def project(out: dict, n: int) -> dict:
    """A second machine: each actor on its own core(s) runs at its measured chunks per CPU
    second; a window then takes the slower actor's share at that rate plus the measured
    coordination overhead (Ray calls, pickling the token ids and vectors, waiting for the
    slower part) of the 2-actor run.

    :returns: ``{"per_actor_chunks_per_cpu_s", "overhead_s_per_window", "projected_2_machines_chunks_per_s",
        "projected_speedup"}``."""
    one, two = out["actors_1"], out["actors_2"]
    rate = min(a["chunks_per_cpu_s"] for a in two["actors"])
    windows = max(1, len(two["overhead_s"]))
    ovh = sum(two["overhead_s"]) / windows
    slow_share = max(a["chunks"] for a in two["actors"])
    t2 = slow_share / rate + ovh * windows
    single = one["actors"][0]["chunks_per_cpu_s"]  # one actor with a whole core of its own
    t1 = n / single + sum(one["overhead_s"])
    return {"per_actor_chunks_per_cpu_s": rate, "single_actor_chunks_per_cpu_s": single,
            "overhead_s_per_window": round(ovh, 3), "projected_1_machine_chunks_per_s": round(n / t1, 1),
            "projected_2_machines_chunks_per_s": round(n / t2, 1), "projected_speedup": round(t1 / t2, 2)}
