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
:func:`analyzer`            the BM25 analyzer                       reference / LangChain BM25
                                                                    over the same tokens
:func:`encoder`             ``TransformersEncoder`` (MiniLM)        same query vectors, same
                                                                    token ids for baselines
:func:`encoder_path`        where the encoder's weights live        baselines load the same
                                                                    model files
:func:`generator`           ``HFGenerator`` (SmolLM2)               LangChain serving baseline
                                                                    runs the same model
:func:`build_context`       the prompt builder                      LangChain baseline sends
                                                                    the same prompt shape
:func:`hit`                 ``domain.Hit`` (shared type)            input of build_context
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


def analyzer():
    """A new instance of the server's BM25 analyzer (``.tokens(text) -> list[str]``)."""
    from oprag_server.index.analyzer import Analyzer

    return Analyzer()


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
