"""The benchmarks' only imports from ``oprag_server`` (server internals), each with its reason.

Benchmarks talk to OpRAG through the public client (gRPC), its command line and its metrics
endpoint. The baselines they compare against must see exactly what the server sees, so a few
server parts are used in process; they are named here once, imported lazily (so a bench that
does not need them never imports torch through them), and when the server moves or renames them
only this file changes.

==========================  ======================================  ===========================
function here               server part                             why
==========================  ======================================  ===========================
:func:`chunk_text`          the server's chunker (MiniLM tokens)    baselines and evaluation
                                                                    sets cut the same chunks
:func:`chunk_chars`         the same chunker on code points         the memory sets' default
                                                                    900-character windows
:func:`analyzer`            the BM25 analyzer                       reference / LangChain BM25
                                                                    over the same tokens
:func:`bm25`                ``index.bm25`` (PostingsIndex,          postings microbench: the
                            CorpusStats)                            shard's index in process
:func:`bm25_top_m`          ``index.bm25.listed_top`` and a         topm_probe: the BM25 top-m
                            snapshot's ``ShardState``               of a loaded shard, pruned
                                                                    and full, in process
:func:`shard_state`         a snapshot's ``ShardState``             shard_parts: one shard's
                                                                    hybrid search by part
:func:`in_process_retriever` ``Retriever`` over snapshots' shards   hybrid_probe: recall vs
                            (``in_process_pool``)                   exact and widening, by knob
:func:`hybrid_module`       ``operators.hybrid`` (Widening, EITHER) hybrid_probe: which lists
                                                                    the widening grew
:func:`encoder`             ``TransformersEncoder`` (MiniLM)        same query vectors, same
                                                                    token ids for baselines
:func:`encoder_path`        where the encoder's weights live        baselines load the same
                                                                    model files
:func:`generator`           ``HFGenerator`` (SmolLM2)               LangChain serving baseline
                                                                    runs the same model
:func:`build_context`       the prompt builder                      LangChain baseline sends
                                                                    the same prompt shape
:func:`hit`                 ``domain.Hit`` (shared type)            input of build_context
:func:`traced_retrieve_job` ``service.tracing.Tracing``, a          tracing bench: the cost of
                            ``QueryJob`` with Retrieve's steps      one traced request in process
:func:`retrieve_merge`      the frontend's merge of replies         hotpath_parts: its CPU
:func:`shard_plane`         the shard layer (pool, transports,      cluster / hotpath_parts
                            state, search, commit protocol)         benches: below gRPC
:func:`managed_engine`,     ``ManagedEngine``, ``OpenAIGenerator``   engine_backends bench runs
:func:`openai_generator`,   (transformers serve, openai backend)    the server's backends alone
:func:`engine_usage`
==========================  ======================================  ===========================
"""

from __future__ import annotations


_CHUNKERS: dict = {}


def chunk_text(text: str, size: int = 256, overlap: int = 0) -> list[str]:
    """The server's default chunker: natural boundaries, at most ``size`` MiniLM tokens
    (special tokens included; ``--chunk-size``/``--chunk-overlap`` of ``oprag serve``)."""
    from oprag_server.models.encoder import resolve_encoder_path
    from oprag_server.operators.chunking import Chunker

    key = (size, overlap)
    if key not in _CHUNKERS:
        _CHUNKERS[key] = Chunker.for_model(resolve_encoder_path("minilm"), 256, size, overlap)
    return _CHUNKERS[key].chunks(text)


def chunk_chars(text: str, size: int = 900, overlap: int = 0) -> list[str]:
    """The server's chunker with sizes in code points (no tokenizer), e.g. 900-character windows."""
    from oprag_server.operators.chunking import chunk_text

    return chunk_text(text, size, overlap)


def analyzer():
    """A new instance of the server's BM25 analyzer (``.tokens(text) -> list[str]``)."""
    from oprag_server.index.analyzer import Analyzer

    return Analyzer()


def bm25():
    """The server's ``oprag_server.index.bm25`` package (``PostingsIndex``, ``CorpusStats``)."""
    from oprag_server.index import bm25 as mod

    return mod


def bm25_top_m(data_dir, dense_kind: str):
    """``(listed_top module, ShardState of shard 0 of data_dir loaded from its snapshot)``."""
    from oprag_server.config import DenseConfig
    from oprag_server.index.bm25 import listed_top
    from oprag_server.shards.state import ShardState

    st = ShardState(0, 384, data_dir, dense=DenseConfig(kind=dense_kind))
    st.load(None)
    return listed_top, st


def shard_state(data_dir, i: int, dense_kind: str, **dense):
    """Shard ``i`` of ``data_dir`` as a ``ShardState`` loaded from its snapshot in this process,
    its log not replayed (``bench.shard_parts``: one shard's search, part by part); ``dense``:
    other ``DenseConfig`` fields (``ann_check``...)."""
    from oprag_server.config import DenseConfig
    from oprag_server.shards.state import ShardState

    st = ShardState(i, 384, data_dir, dense=DenseConfig(kind=dense_kind, **dense))
    st.load(None)
    return st


def in_process_retriever(data_dir, n_shards: int, dense_kind: str, dense: dict | None = None, **cfg):
    """``(Retriever, RetrieveSpec, states)``: the frontend's retriever over every shard of
    ``data_dir`` loaded in this process from its snapshot (log not replayed), corpus statistics
    summed from the shards as a starting server does, ``RetrievalConfig(**cfg)``
    (``bench.hybrid_probe``: dense-first recall vs exact mode and widening, in process)."""
    from oprag_server.config import BM25Config, RetrievalConfig
    from oprag_server.index.analyzer import Analyzer
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.operators.retrieve import Retriever, RetrieveSpec
    from oprag_server.shards.inprocess import in_process_pool

    states = [shard_state(data_dir, i, dense_kind, **(dense or {})) for i in range(n_shards)]
    stats = CorpusStats.merge_full([s.store.postings.full_stats() for s in states])
    return (Retriever(in_process_pool(states), stats, Analyzer(), BM25Config(), RetrievalConfig(**cfg)),
            RetrieveSpec, states)


def hybrid_module():
    """``oprag_server.operators.hybrid`` (``bench.hybrid_probe`` counts the widening requests of
    ``Widening.next_round`` and sets ``EITHER``, which no public API exposes)."""
    from oprag_server.operators import hybrid

    return hybrid


def encoder(name: str = "minilm", **kw):
    """The server's ``TransformersEncoder(name, **kw)`` (``encode(texts, truncate=True) ->
    float32[n, dim]``, ``tokenize``, ``encode_tokenized``...)."""
    from oprag_server.models.encoder import TransformersEncoder

    return TransformersEncoder(name, **kw)


def encoder_path(name: str = "minilm") -> str:
    """Directory of the encoder's model files, as the server resolves it."""
    from oprag_server.models.encoder import resolve_encoder_path

    return str(resolve_encoder_path(name))


def generator(name: str = "smollm2", **kw):
    """The server's ``HFGenerator(name, **kw)``."""
    from oprag_server.models.generator import HFGenerator

    return HFGenerator(name, **kw)


def build_context(question: str, hits: list, model, *, budget_tokens: int, max_new_tokens: int):
    """The server's prompt builder; returns its ``ContextPayload`` (``.prompt``, ``.sources``)."""
    from oprag_server.operators.context import build_context as _build_context

    return _build_context(question, hits, model, budget_tokens=budget_tokens, max_new_tokens=max_new_tokens)


def hit(**fields):
    """``oprag_server.domain.Hit(**fields)``: the shared retrieval-hit type."""
    from oprag_server.domain import Hit

    return Hit(**fields)


def retrieve_merge():
    """The frontend's merge of shard search replies, for ``bench.hotpath_parts --part merge``:
    ``(merge(replies, j, spec), collect(into, replies, attr), RetrieveSpec)`` of ``operators.retrieve`` (collect
    the carried fields; global top-N and fusion, ``Retriever._merge``, which uses no instance
    state; no public API runs them without the transport)."""
    from oprag_server.operators import retrieve as r

    if hasattr(r, "_Carried"):  # (a tree before the lookup per hit kept a dict: _collect)
        collect = lambda into, replies, attr: r._Carried().add(replies)  # noqa: E731
    else:
        collect = r._collect
    return (lambda replies, j, spec: r.Retriever._merge(r.Retriever, replies, j, spec)), collect, r.RetrieveSpec


def shard_plane():
    """The shard layer below gRPC, for ``bench.cluster`` (it measures the frontend-to-shard data
    plane of the pipe and Ray transports and node loss under the commit protocol, which no
    public API exposes): a namespace of ``records``, ``protocol``, ``ShardPool``,
    ``PipeTransport``, ``ShardError``, ``ShardState``, ``in_process_pool``, ``CommitProtocol``,
    ``RWLock``, ``CorpusStats``, ``RayConfig``, ``RayPlacement`` (needs the 'ray' extra when
    used), ``ShardSupervisor``, ``restart_shard`` and ``RayEmbedPool`` (the ingest embedding
    actors, ``bench.embed_actors``); ``search`` (the shard search module, whose phases
    ``bench.hotpath_parts`` times one by one)."""
    from types import SimpleNamespace

    from oprag_server import records
    from oprag_server.config import RayConfig
    from oprag_server.engine.commit import CommitProtocol
    from oprag_server.engine.ray_embed import RayEmbedPool
    from oprag_server.engine.rwlock import RWLock
    from oprag_server.index.bm25 import CorpusStats
    from oprag_server.shards import protocol
    from oprag_server.shards.inprocess import in_process_pool
    from oprag_server.shards.pool import ShardPool
    from oprag_server.shards import search
    from oprag_server.shards.ray_transport import RayPlacement
    from oprag_server.shards.state import ShardState
    from oprag_server.shards.transport import PipeTransport, ShardError
    from oprag_server.supervision import ShardSupervisor, restart_shard

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "SimpleNamespace"})


def traced_retrieve_job(endpoint: str):
    """``(tracing, job)``: the server's ``Tracing.otlp(endpoint)`` (BatchSpanProcessor + OTLP/gRPC
    exporter) and a finished ``QueryJob`` holding a Retrieve's two executed steps (embed,
    retrieve); ``tracing.export(job, carrier=...)`` is what a traced request adds."""
    from oprag_server.domain import RetrieveSpec
    from oprag_server.engine.job import QueryJob
    from oprag_server.engine.scheduler import PlanStep
    from oprag_server.service.tracing import Tracing

    job = QueryJob(question="q", spec=RetrieveSpec(), request_id="bench")
    job.batch_id = 1
    job.record(PlanStep("embed", "embed-worker"), job.enqueued + 0.004, 0.003)
    job.record(PlanStep("retrieve", "shard"), job.enqueued + 0.006, 0.002)
    return Tracing.otlp(endpoint), job


def managed_engine(model_dir, **kw):
    """``ManagedEngine``: ``transformers serve`` as a supervised child process (engine bench)."""
    from oprag_server.models.managed_engine import ManagedEngine

    return ManagedEngine(model_dir, **kw)


def openai_generator(url: str, model: str, **kw):
    """``OpenAIGenerator``: the server's openai backend (engine bench streams through it)."""
    from oprag_server.models.openai_engine import OpenAIGenerator

    return OpenAIGenerator(url, model, **kw)


def engine_usage():
    """A fresh ``EngineUsage`` (filled in by ``OpenAIGenerator.stream``)."""
    from oprag_server.models.protocols import EngineUsage

    return EngineUsage()


def one_thread() -> None:
    """Limit BLAS and FAISS's OpenMP in this process to one thread, as a shard process runs them."""
    import os

    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    import faiss

    faiss.omp_set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:
        import sys

        print("threadpoolctl missing: BLAS may use several threads", file=sys.stderr)


def query_vectors(texts: list[str], cache: str = ""):
    """float32[len(texts), 384] MiniLM vectors of ``texts``, read from / saved to the ``.npy``
    file ``cache`` when one is named."""
    import numpy as np
    from pathlib import Path

    path = Path(cache) if cache else None
    if path is not None and path.exists():
        return np.load(path)[: len(texts)]
    vecs = encoder("minilm", device="cpu").encode(texts, truncate=True).astype(np.float32)
    if path is not None:
        np.save(path, vecs)
    return vecs


def probe_shard(a):
    """``(shard_plane(), ShardState)`` for an in-process probe of shard ``a.shard`` of
    ``a.data_dir`` (:func:`._common.shard_probe_args`): BLAS and FAISS on one thread as in a shard
    process, the shard loaded from its snapshot and its kernels warmed (delta_cost, widen_probe)."""
    one_thread()
    sp = shard_plane()
    st = shard_state(a.data_dir, a.shard, a.dense_index)
    st.search.warm()
    return sp, st


def shard_avgdl(ix) -> float:
    """One shard's average BM25 document length (``PostingsIndex`` ``ix``): the ``avgdl`` its
    probes score with (delta_cost, shard_parts, topm_probe, widen_probe)."""
    import numpy as np

    return float(np.asarray(ix._doc_len).sum() / max(len(ix), 1))  # noqa: SLF001


def shard_idf(ix):
    """``(terms -> float64[T] idf, average idf)``: rank_bm25's Okapi idf with one shard's
    document frequencies (``PostingsIndex`` ``ix``, merged), a negative idf floored at 0.25 x the
    average idf over the shard's whole vocabulary (as ``CorpusStats.query_idf`` does over the
    corpus), 0 for a term it does not hold."""
    import numpy as np

    n = len(ix)
    sdf = np.asarray(ix._seg_df, np.float64)  # noqa: SLF001 - every term of the (merged) shard
    sdf = sdf[sdf > 0]
    avg = float(np.log((n - sdf + 0.5) / (sdf + 0.5)).mean()) if sdf.size else 0.0

    def idf(terms):
        df = np.array([ix.df(t) for t in terms], np.float64)
        raw = np.log((n - df + 0.5) / (df + 0.5))
        return np.where(df == 0, 0.0, np.where(raw < 0, 0.25 * avg, raw))

    return idf, avg
