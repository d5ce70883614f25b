from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetrievalMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETRIEVAL_MODE_UNSPECIFIED: _ClassVar[RetrievalMode]
    HYBRID: _ClassVar[RetrievalMode]
    DENSE: _ClassVar[RetrievalMode]
    LEXICAL: _ClassVar[RetrievalMode]
    FULL_HYBRID: _ClassVar[RetrievalMode]

class Fusion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FUSION_UNSPECIFIED: _ClassVar[Fusion]
    WEIGHTED_MINMAX: _ClassVar[Fusion]
    RRF: _ClassVar[Fusion]
RETRIEVAL_MODE_UNSPECIFIED: RetrievalMode
HYBRID: RetrievalMode
DENSE: RetrievalMode
LEXICAL: RetrievalMode
FULL_HYBRID: RetrievalMode
FUSION_UNSPECIFIED: Fusion
WEIGHTED_MINMAX: Fusion
RRF: Fusion

class MetadataValue(_message.Message):
    __slots__ = ("string_value", "int_value", "float_value", "bool_value")
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    string_value: str
    int_value: int
    float_value: float
    bool_value: bool
    def __init__(self, string_value: _Optional[str] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., bool_value: _Optional[bool] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "title", "text", "metadata", "typed_metadata", "vector", "chunks", "vectors_f32", "vector_dim")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TypedMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: MetadataValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[MetadataValue, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TYPED_METADATA_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    VECTORS_F32_FIELD_NUMBER: _ClassVar[int]
    VECTOR_DIM_FIELD_NUMBER: _ClassVar[int]
    id: str
    title: str
    text: str
    metadata: _containers.ScalarMap[str, str]
    typed_metadata: _containers.MessageMap[str, MetadataValue]
    vector: _containers.RepeatedScalarFieldContainer[float]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkVector]
    vectors_f32: bytes
    vector_dim: int
    def __init__(self, id: _Optional[str] = ..., title: _Optional[str] = ..., text: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., typed_metadata: _Optional[_Mapping[str, MetadataValue]] = ..., vector: _Optional[_Iterable[float]] = ..., chunks: _Optional[_Iterable[_Union[ChunkVector, _Mapping]]] = ..., vectors_f32: _Optional[bytes] = ..., vector_dim: _Optional[int] = ...) -> None: ...

class ChunkVector(_message.Message):
    __slots__ = ("text", "vector")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    text: str
    vector: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, text: _Optional[str] = ..., vector: _Optional[_Iterable[float]] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("documents", "final", "sent_documents")
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    SENT_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    final: bool
    sent_documents: int
    def __init__(self, documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ..., final: _Optional[bool] = ..., sent_documents: _Optional[int] = ...) -> None: ...

class RejectedDocument(_message.Message):
    __slots__ = ("index", "id", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    reason: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("documents_written", "chunks_written", "documents_replaced", "rejected", "chunks_split", "seq", "elapsed_ms", "chunks_reused")
    DOCUMENTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SPLIT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    documents_written: int
    chunks_written: int
    documents_replaced: int
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedDocument]
    chunks_split: int
    seq: int
    elapsed_ms: float
    chunks_reused: int
    def __init__(self, documents_written: _Optional[int] = ..., chunks_written: _Optional[int] = ..., documents_replaced: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[RejectedDocument, _Mapping]]] = ..., chunks_split: _Optional[int] = ..., seq: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., chunks_reused: _Optional[int] = ...) -> None: ...

class FusionOptions(_message.Message):
    __slots__ = ("method", "dense_weight", "lexical_weight", "rrf_k")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DENSE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RRF_K_FIELD_NUMBER: _ClassVar[int]
    method: Fusion
    dense_weight: float
    lexical_weight: float
    rrf_k: int
    def __init__(self, method: _Optional[_Union[Fusion, str]] = ..., dense_weight: _Optional[float] = ..., lexical_weight: _Optional[float] = ..., rrf_k: _Optional[int] = ...) -> None: ...

class MetadataFilter(_message.Message):
    __slots__ = ("key", "values", "typed_values")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TYPED_VALUES_FIELD_NUMBER: _ClassVar[int]
    key: str
    values: _containers.RepeatedScalarFieldContainer[str]
    typed_values: _containers.RepeatedCompositeFieldContainer[MetadataValue]
    def __init__(self, key: _Optional[str] = ..., values: _Optional[_Iterable[str]] = ..., typed_values: _Optional[_Iterable[_Union[MetadataValue, _Mapping]]] = ...) -> None: ...

class GenerationOptions(_message.Message):
    __slots__ = ("max_new_tokens", "stop")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("question", "top_k", "mode", "session_id", "generation", "candidates", "disable_memory", "filters", "fusion", "query_vector", "min_seq", "include_trace", "group_by_document", "chunks_per_document", "ef_search", "nprobe")
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DISABLE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    FILTERS_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    QUERY_VECTOR_FIELD_NUMBER: _ClassVar[int]
    MIN_SEQ_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TRACE_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PER_DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    EF_SEARCH_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    question: str
    top_k: int
    mode: RetrievalMode
    session_id: str
    generation: GenerationOptions
    candidates: int
    disable_memory: bool
    filters: _containers.RepeatedCompositeFieldContainer[MetadataFilter]
    fusion: FusionOptions
    query_vector: _containers.RepeatedScalarFieldContainer[float]
    min_seq: int
    include_trace: bool
    group_by_document: bool
    chunks_per_document: int
    ef_search: int
    nprobe: int
    def __init__(self, question: _Optional[str] = ..., top_k: _Optional[int] = ..., mode: _Optional[_Union[RetrievalMode, str]] = ..., session_id: _Optional[str] = ..., generation: _Optional[_Union[GenerationOptions, _Mapping]] = ..., candidates: _Optional[int] = ..., disable_memory: _Optional[bool] = ..., filters: _Optional[_Iterable[_Union[MetadataFilter, _Mapping]]] = ..., fusion: _Optional[_Union[FusionOptions, _Mapping]] = ..., query_vector: _Optional[_Iterable[float]] = ..., min_seq: _Optional[int] = ..., include_trace: _Optional[bool] = ..., group_by_document: _Optional[bool] = ..., chunks_per_document: _Optional[int] = ..., ef_search: _Optional[int] = ..., nprobe: _Optional[int] = ...) -> None: ...

class DocumentHit(_message.Message):
    __slots__ = ("doc_id", "title", "score", "hits")
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    doc_id: str
    title: str
    score: float
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    def __init__(self, doc_id: _Optional[str] = ..., title: _Optional[str] = ..., score: _Optional[float] = ..., hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ...) -> None: ...

class StageTrace(_message.Message):
    __slots__ = ("op", "domain", "batch_id", "queue_ms", "run_ms")
    OP_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_MS_FIELD_NUMBER: _ClassVar[int]
    op: str
    domain: str
    batch_id: int
    queue_ms: float
    run_ms: float
    def __init__(self, op: _Optional[str] = ..., domain: _Optional[str] = ..., batch_id: _Optional[int] = ..., queue_ms: _Optional[float] = ..., run_ms: _Optional[float] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageTrace]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageTrace, _Mapping]]] = ...) -> None: ...

class SourcesEvent(_message.Message):
    __slots__ = ("request_id", "hits", "sources", "retrieval", "memory_context", "documents", "memory_used", "resolved_query")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_QUERY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    retrieval: RetrievalInfo
    memory_context: str
    documents: _containers.RepeatedCompositeFieldContainer[DocumentHit]
    memory_used: bool
    resolved_query: str
    def __init__(self, request_id: _Optional[str] = ..., hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., retrieval: _Optional[_Union[RetrievalInfo, _Mapping]] = ..., memory_context: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[DocumentHit, _Mapping]]] = ..., memory_used: _Optional[bool] = ..., resolved_query: _Optional[str] = ...) -> None: ...

class DoneEvent(_message.Message):
    __slots__ = ("answer", "timings_ms", "prompt_tokens", "completion_tokens", "finish_reason", "ttft_ms", "trace")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    answer: str
    timings_ms: _containers.ScalarMap[str, float]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_ms: float
    trace: Trace
    def __init__(self, answer: _Optional[str] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., trace: _Optional[_Union[Trace, _Mapping]] = ...) -> None: ...

class QueryEvent(_message.Message):
    __slots__ = ("sources", "text", "done")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    sources: SourcesEvent
    text: str
    done: DoneEvent
    def __init__(self, sources: _Optional[_Union[SourcesEvent, _Mapping]] = ..., text: _Optional[str] = ..., done: _Optional[_Union[DoneEvent, _Mapping]] = ...) -> None: ...

class RetrievalInfo(_message.Message):
    __slots__ = ("mode", "fusion", "dense_weight", "lexical_weight", "rrf_k", "candidates", "chunks_searched", "partial", "missing_shards", "dense_index", "ef_search", "nprobe", "lexical_candidates", "certified", "widen_rounds", "exact")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RRF_K_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SEARCHED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    MISSING_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DENSE_INDEX_FIELD_NUMBER: _ClassVar[int]
    EF_SEARCH_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CERTIFIED_FIELD_NUMBER: _ClassVar[int]
    WIDEN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    fusion: str
    dense_weight: float
    lexical_weight: float
    rrf_k: int
    candidates: int
    chunks_searched: int
    partial: bool
    missing_shards: _containers.RepeatedScalarFieldContainer[int]
    dense_index: str
    ef_search: int
    nprobe: int
    lexical_candidates: int
    certified: bool
    widen_rounds: int
    exact: bool
    def __init__(self, mode: _Optional[str] = ..., fusion: _Optional[str] = ..., dense_weight: _Optional[float] = ..., lexical_weight: _Optional[float] = ..., rrf_k: _Optional[int] = ..., candidates: _Optional[int] = ..., chunks_searched: _Optional[int] = ..., partial: _Optional[bool] = ..., missing_shards: _Optional[_Iterable[int]] = ..., dense_index: _Optional[str] = ..., ef_search: _Optional[int] = ..., nprobe: _Optional[int] = ..., lexical_candidates: _Optional[int] = ..., certified: _Optional[bool] = ..., widen_rounds: _Optional[int] = ..., exact: _Optional[bool] = ...) -> None: ...

class Hit(_message.Message):
    __slots__ = ("chunk_id", "doc_id", "title", "text", "score", "dense_score", "lexical_score", "shard", "metadata", "dense_rank", "lexical_rank", "typed_metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TypedMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: MetadataValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[MetadataValue, _Mapping]] = ...) -> None: ...
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DENSE_SCORE_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DENSE_RANK_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_RANK_FIELD_NUMBER: _ClassVar[int]
    TYPED_METADATA_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    doc_id: str
    title: str
    text: str
    score: float
    dense_score: float
    lexical_score: float
    shard: int
    metadata: _containers.ScalarMap[str, str]
    dense_rank: int
    lexical_rank: int
    typed_metadata: _containers.MessageMap[str, MetadataValue]
    def __init__(self, chunk_id: _Optional[str] = ..., doc_id: _Optional[str] = ..., title: _Optional[str] = ..., text: _Optional[str] = ..., score: _Optional[float] = ..., dense_score: _Optional[float] = ..., lexical_score: _Optional[float] = ..., shard: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., dense_rank: _Optional[int] = ..., lexical_rank: _Optional[int] = ..., typed_metadata: _Optional[_Mapping[str, MetadataValue]] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("number", "chunk_id", "doc_id", "title", "tokens", "truncated")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    number: int
    chunk_id: str
    doc_id: str
    title: str
    tokens: int
    truncated: bool
    def __init__(self, number: _Optional[int] = ..., chunk_id: _Optional[str] = ..., doc_id: _Optional[str] = ..., title: _Optional[str] = ..., tokens: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("answer", "hits", "timings_ms", "request_id", "sources", "prompt_tokens", "completion_tokens", "finish_reason", "memory_context", "retrieval", "trace", "ttft_ms", "documents", "memory_used", "resolved_query")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_QUERY_FIELD_NUMBER: _ClassVar[int]
    answer: str
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    timings_ms: _containers.ScalarMap[str, float]
    request_id: str
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    memory_context: str
    retrieval: RetrievalInfo
    trace: Trace
    ttft_ms: float
    documents: _containers.RepeatedCompositeFieldContainer[DocumentHit]
    memory_used: bool
    resolved_query: str
    def __init__(self, answer: _Optional[str] = ..., hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., request_id: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., memory_context: _Optional[str] = ..., retrieval: _Optional[_Union[RetrievalInfo, _Mapping]] = ..., trace: _Optional[_Union[Trace, _Mapping]] = ..., ttft_ms: _Optional[float] = ..., documents: _Optional[_Iterable[_Union[DocumentHit, _Mapping]]] = ..., memory_used: _Optional[bool] = ..., resolved_query: _Optional[str] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("hits", "timings_ms", "request_id", "memory_context", "retrieval", "trace", "documents", "memory_used", "resolved_query")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_QUERY_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    timings_ms: _containers.ScalarMap[str, float]
    request_id: str
    memory_context: str
    retrieval: RetrievalInfo
    trace: Trace
    documents: _containers.RepeatedCompositeFieldContainer[DocumentHit]
    memory_used: bool
    resolved_query: str
    def __init__(self, hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., request_id: _Optional[str] = ..., memory_context: _Optional[str] = ..., retrieval: _Optional[_Union[RetrievalInfo, _Mapping]] = ..., trace: _Optional[_Union[Trace, _Mapping]] = ..., documents: _Optional[_Iterable[_Union[DocumentHit, _Mapping]]] = ..., memory_used: _Optional[bool] = ..., resolved_query: _Optional[str] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("doc_ids",)
    DOC_IDS_FIELD_NUMBER: _ClassVar[int]
    doc_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, doc_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("documents_deleted", "chunks_deleted", "seq")
    DOCUMENTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    documents_deleted: int
    chunks_deleted: int
    seq: int
    def __init__(self, documents_deleted: _Optional[int] = ..., chunks_deleted: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ClearSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ClearSessionResponse(_message.Message):
    __slots__ = ("records_removed",)
    RECORDS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    records_removed: int
    def __init__(self, records_removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("shard", "documents", "chunks", "memory_records", "applied_seq", "postings_bytes", "terms_bytes", "vectors_bytes", "ann_bytes", "chunks_bytes", "ann_pending", "merge_pending", "segment_unsaved_bytes", "seeds_pending")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RECORDS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    POSTINGS_BYTES_FIELD_NUMBER: _ClassVar[int]
    TERMS_BYTES_FIELD_NUMBER: _ClassVar[int]
    VECTORS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ANN_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ANN_PENDING_FIELD_NUMBER: _ClassVar[int]
    MERGE_PENDING_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_UNSAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEEDS_PENDING_FIELD_NUMBER: _ClassVar[int]
    shard: int
    documents: int
    chunks: int
    memory_records: int
    applied_seq: int
    postings_bytes: int
    terms_bytes: int
    vectors_bytes: int
    ann_bytes: int
    chunks_bytes: int
    ann_pending: int
    merge_pending: int
    segment_unsaved_bytes: int
    seeds_pending: int
    def __init__(self, shard: _Optional[int] = ..., documents: _Optional[int] = ..., chunks: _Optional[int] = ..., memory_records: _Optional[int] = ..., applied_seq: _Optional[int] = ..., postings_bytes: _Optional[int] = ..., terms_bytes: _Optional[int] = ..., vectors_bytes: _Optional[int] = ..., ann_bytes: _Optional[int] = ..., chunks_bytes: _Optional[int] = ..., ann_pending: _Optional[int] = ..., merge_pending: _Optional[int] = ..., segment_unsaved_bytes: _Optional[int] = ..., seeds_pending: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("documents", "chunks", "memory_records", "seq", "shards", "embedder", "generator", "missing_shards")
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDER_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_FIELD_NUMBER: _ClassVar[int]
    MISSING_SHARDS_FIELD_NUMBER: _ClassVar[int]
    documents: int
    chunks: int
    memory_records: int
    seq: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardStats]
    embedder: str
    generator: str
    missing_shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, documents: _Optional[int] = ..., chunks: _Optional[int] = ..., memory_records: _Optional[int] = ..., seq: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardStats, _Mapping]]] = ..., embedder: _Optional[str] = ..., generator: _Optional[str] = ..., missing_shards: _Optional[_Iterable[int]] = ...) -> None: ...
