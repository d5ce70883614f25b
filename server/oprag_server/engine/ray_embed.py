"""Embedding workers as Ray actors for bulk ingest (``oprag serve --ray-address ... --ray-embed-actors N``).

The frontend still chunks and tokenises (the ingest transform stage); :class:`RayEmbedPool`
takes the stage's windows of token ids, cuts them into the batches the in-process embedder
would run (sorted by length, ``batch_size`` rows: the same padding, so the same vectors), deals
the batches out to the actors by token count (longest first to the least loaded) and puts the
vectors back in input order. It has the ``embed_chunks`` method of
:class:`~oprag_server.engine.embedder.EmbedWorker`, so the ingest pipeline takes it in place of
the in-process worker; query embedding stays in the frontend. The actors only compute vectors:
staging and the all-or-nothing commit of a stream are unchanged.

Placement (:func:`plan_actors`): on a cluster that reports GPUs, one actor per GPU
(``num_gpus=1``; Ray sets the actor's ``CUDA_VISIBLE_DEVICES``, the encoder runs on ``cuda``
with its ``dtype`` option, ``"auto"`` = bfloat16 + SDPA there); otherwise one CPU actor per node
(``--ray-embed-gpus``, ``--ray-embed-actors``, ``--ray-embed-cpus``).

Embedding is a pure function, so a batch whose actor fails (node lost, Ray restarting it) is
sent again to another live actor; only when every actor fails does the call raise, and the
stream is aborted as for any other embedding error. bench/RESULTS.md ("Ingest over embedding
actors") has the rates.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ActorPlan", "EmbedActor", "RayEmbedPool", "plan_actors", "plan_batches", "start_embed_pool"]
log = logging.getLogger("oprag")


class EmbedActor:
    """The body of an embedding actor: a :class:`~oprag_server.models.encoder.TransformersEncoder`
    loaded from ``model`` (a directory every node reads, or a model name) with ``threads`` torch
    threads. Ray re-runs the constructor on a restart; the actor holds no state but the model."""

    def __init__(self, model: str, threads: int, encoder_kw: dict) -> None:
        import torch

        from ..models.encoder import TransformersEncoder

        torch.set_num_threads(max(1, threads))
        self.encoder = TransformersEncoder(model, **encoder_kw)
        self.encoder.warm_up()
        self.chunks = 0
        self.busy_s = 0.0

    def encode(self, ids: list[list[int]]) -> np.ndarray:
        """float32[len(ids), dim] (:meth:`TransformersEncoder.encode_tokenized`)."""
        t = time.perf_counter()
        out = self.encoder.encode_tokenized(ids)
        self.busy_s += time.perf_counter() - t
        self.chunks += len(ids)
        return out

    def usage(self) -> dict:
        """``{"node", "pid", "cpu_s" (this process's CPU seconds so far), "busy_s" (wall seconds
        inside encode), "chunks"}``."""
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "cpu_s": time.process_time(), "busy_s": self.busy_s, "chunks": self.chunks}


def plan_batches(ids: list[list[int]], batch_size: int, workers: int) -> list[list[int]]:
    """Deal the inputs to ``workers`` by batches: indices sorted by length (longest first, ties
    in input order), cut into batches of ``batch_size`` (exactly the batches
    :meth:`TransformersEncoder.encode_tokenized` forms for the whole list), each batch to the
    worker with the fewest padded tokens so far (width x rows).

    :returns: per worker, the input indices it embeds (a concatenation of whole batches, in
        sorted order, so the worker's own sort re-forms the same batches).
    """
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    plan: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        w = min(range(workers), key=lambda k: (load[k], k))
        load[w] += len(ids[batch[0]]) * len(batch)
        plan[w].extend(batch)
    return plan


@dataclass(frozen=True)
class ActorPlan:
    """How many embedding actors, with what each reserves and where its encoder runs.

    ``n``: actors (-1 = one per node with CPUs, counted by :class:`RayEmbedPool`); ``cpus``,
    ``gpus``: Ray resources per actor; ``device``: the encoder's device inside the actor;
    ``keep_placed``: keep the actors placed within a minute and drop the rest (counted, not
    asked for) instead of failing the start."""

    n: int
    cpus: float
    gpus: float
    device: str
    keep_placed: bool


def plan_actors(embed_actors: int, embed_gpus: str, cpus: float, device: str, cluster_gpus: float) -> ActorPlan | None:
    """The embedding actors for ``--ray-embed-actors`` / ``--ray-embed-gpus`` / ``--ray-embed-cpus``
    (:class:`~oprag_server.config.RayConfig`) on a cluster with ``cluster_gpus`` GPUs in all
    (``ray.cluster_resources()["GPU"]``). ``device`` is the frontend's ``--embed`` device
    setting (kept for CPU actors: Ray hides GPUs from an actor that reserved none).

    :returns: None for ``embed_actors == 0`` (ingest embeds in the frontend). GPUs (``"auto"``
        and ``cluster_gpus >= 1``, or an explicit count > 0): ``embed_actors`` actors if > 0 else
        one per GPU, one GPU each, on ``cuda``. Otherwise CPU actors exactly as without GPUs.
    """
    if embed_actors == 0:
        return None
    gpus = int(cluster_gpus) if embed_gpus == "auto" else int(embed_gpus)
    if gpus > 0:
        n = embed_actors if embed_actors > 0 else gpus
        return ActorPlan(n=n, cpus=cpus, gpus=1.0, device="cuda", keep_placed=embed_actors < 0 and embed_gpus == "auto")
    return ActorPlan(n=embed_actors, cpus=cpus, gpus=0.0, device=device, keep_placed=embed_actors < 0)


class RayEmbedPool:
    """``n`` :class:`EmbedActor` s spread over the nodes (scheduling strategy ``SPREAD``,
    ``cpus`` CPUs each, restarted by Ray without task retries). Ray must be connected.

    :param model: the encoder's model directory (as the frontend resolved it: every node must
        read it, e.g. the same image) and ``encoder_kw`` its other arguments.
    :param n: actors; -1 = one per alive node with CPUs.
    :param gpus: GPUs reserved per actor (0: a CPU actor; Ray then hides every GPU from it).
    :param batch_size: rows per forward pass (the frontend encoder's ``batch_size``).
    """

    def __init__(self, model: str, encoder_kw: dict, *, n: int = -1, cpus: float = 1.0, batch_size: int = 32,
                 metrics: Any = None, gpus: float = 0.0) -> None:
        import ray

        if n < 0:
            n = max(1, sum(1 for node in ray.nodes() if node.get("Alive") and node["Resources"].get("CPU", 0) > 0))
        self.n, self.batch_size, self.metrics = n, batch_size, metrics
        self.options = {"num_cpus": cpus, "max_restarts": -1, "max_task_retries": 0, "scheduling_strategy": "SPREAD"}
        if gpus:
            self.options["num_gpus"] = gpus
        cls = ray.remote(EmbedActor).options(**self.options)
        kw = {**encoder_kw, "batch_size": batch_size}
        self.actors = [cls.remote(model, int(cpus) or 1, kw) for _ in range(n)]
        self.retried = 0  # parts sent again after their actor was lost

    def ready(self, timeout_s: float = 300.0, keep_placed: bool = False) -> list[dict]:
        """Wait until every actor has loaded its model (blocking). With ``keep_placed``, the
        actors not placed and loaded within ``timeout_s`` are dropped instead (no free CPUs on
        their node) as long as one is. :returns: each kept actor's :meth:`EmbedActor.usage`.
        :raises RuntimeError: not placed and loaded in time (with ``keep_placed``: none was)."""
        import ray

        refs = [a.usage.remote() for a in self.actors]
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending and not (keep_placed and done):
            raise RuntimeError(f"{len(pending)} of {self.n} Ray embedding actors were not placed and loaded within "
                               f"{timeout_s:.0f} s (free CPUs? see --ray-embed-actors / --ray-embed-cpus)")
        kept = [i for i, r in enumerate(refs) if r in done]
        for i in set(range(self.n)) - set(kept):
            ray.kill(self.actors[i], no_restart=True)
        self.actors, self.n = [self.actors[i] for i in kept], len(kept)
        return ray.get([refs[i] for i in kept])

    def usage(self) -> list[dict]:
        """Every live actor's :meth:`EmbedActor.usage` (blocking)."""
        import ray

        return ray.get([a.usage.remote() for a in self.actors], timeout=60)

    async def embed_chunks(self, ids: list[list[int]]) -> np.ndarray:
        """float32[len(ids), D] for pre-tokenised chunks, computed by the actors (see the module
        doc). :raises RuntimeError: a part failed on every actor in turn; an encoder error
        (e.g. ValueError for an over-long input) is raised as is."""
        t = time.perf_counter()
        parts = [p for p in plan_batches(ids, self.batch_size, self.n) if p]
        got = await asyncio.gather(*[self._part(k, [ids[i] for i in p]) for k, p in enumerate(parts)])
        out = np.empty((len(ids), got[0].shape[1] if got else 0), dtype=np.float32)
        for p, v in zip(parts, got):
            out[p] = v  # a copy: arrays from Ray are read-only views of its object store
        if self.metrics is not None:
            self.metrics.stage_seconds.labels(stage="embed").observe(time.perf_counter() - t)
        return out

    async def _part(self, k: int, sub: list[list[int]]) -> np.ndarray:
        import ray

        lost = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
        for attempt in range(2 * self.n + 1):  # embedding is pure: a lost call is sent again
            try:
                return await asyncio.wrap_future(self.actors[(k + attempt) % self.n].encode.remote(sub).future())
            except lost as exc:
                last = exc
                self.retried += 1
                await asyncio.sleep(0.2)
        raise RuntimeError(f"every Ray embedding actor failed: {last}") from last

    def close(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


def start_embed_pool(cfg: Any, encoder: Any, metrics: Any = None, timeout_s: float = 300.0) -> RayEmbedPool | None:
    """The ingest embedding actors of a :class:`~oprag_server.config.ServerConfig` (blocking,
    Ray connected: call after the shard pool started), or None without ``--ray-address`` or
    with ``--ray-embed-actors 0``. The actors load ``encoder``'s model directory with its
    settings. :raises RuntimeError: not placed and loaded within ``timeout_s``."""
    r = cfg.ray
    if r.address is None or r.embed_actors == 0:
        return None
    import ray

    gpus = float(ray.cluster_resources().get("GPU", 0)) if r.embed_gpus == "auto" else 0.0
    plan = plan_actors(r.embed_actors, r.embed_gpus, r.embed_cpus, cfg.embed.device, gpus)
    kw = {"device": plan.device, "max_tokens": encoder.max_tokens, "compile": cfg.embed.compile,
          "dtype": getattr(encoder, "_requested_dtype", "auto")}  # the frontend's setting, not its CPU resolution
    pool = RayEmbedPool(str(encoder.path), kw, n=plan.n, cpus=plan.cpus, gpus=plan.gpus,
                        batch_size=cfg.embed.batch_size, metrics=metrics)
    what = "one GPU each, encoder on cuda" if plan.gpus else "CPU"
    if not plan.keep_placed:  # asked for N: all of them, or a start-up error
        pool.ready(timeout_s)
    else:
        try:  # one per node (or GPU): the ones placed with what the shards left free
            pool.ready(min(timeout_s, 60.0), keep_placed=True)
        except RuntimeError:
            log.warning("no Ray embedding actor could be placed (no free %s): ingest embeds in the frontend",
                        "GPUs" if plan.gpus else "CPUs")
            pool.close()
            return None
    log.info("%d Ray embedding actors for ingest (%s)", pool.n, what)
    return pool
