"""The frontend's hot-path shortcuts keep what crosses the pipe and what the caller sees
unchanged: a broadcast request's frame is pickled once and unpickles on the shard as the request;
hit fields carried by search replies are found per hit as the old dict over all of them found
them; memoised metric children are the ones prometheus_client returns."""

from __future__ import annotations

import pickle

import numpy as np

from oprag_server.operators.retrieve import _Carried
from oprag_server.service.metrics import Metrics
from oprag_server.shards import transport
from oprag_server.shards.protocol import FetchReply, Op, QueryBatch, SearchReply, SearchRequest


def _req(seed: int) -> SearchRequest:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, 8)).astype(np.float32)
    batch = QueryBatch(q, [["alpha", "beta"], ["gamma"]], [np.array([0.5, 1.5]), np.array([2.0])], 7.5, 1.5, 0.75,
                       [[("lang", ("en",))], []])
    return SearchRequest(batch, "hybrid", 256, 0, 0, 10)


def _fields(a, b) -> tuple:
    return tuple(np.asarray(x).tolist() if isinstance(x, np.ndarray) else x for x in (a, b))


def _unframe(frame: bytes):
    n = int.from_bytes(frame[:4], "big", signed=True)
    assert n == len(frame) - 4
    return pickle.loads(frame[4:])


def test_a_shared_request_frame_unpickles_as_the_request_itself():
    req = _req(0)
    old = pickle.loads(pickle.dumps((7, Op.SEARCH, req), protocol=pickle.HIGHEST_PROTOCOL))
    req_id, frame = transport._shared_frame(Op.SEARCH, req, object())
    new = _unframe(frame)
    assert new[0] == req_id and new[1] is old[1] and type(new[2]) is SearchRequest
    for name in ("mode", "n", "ef_search", "nprobe", "fetch_k"):
        assert getattr(old[2], name) == getattr(new[2], name)
    ob, nb = old[2].batch, new[2].batch
    assert ob.q.dtype == nb.q.dtype and ob.q.tobytes() == nb.q.tobytes()
    assert ob.terms == nb.terms and ob.filters == nb.filters and (ob.avgdl, ob.k1, ob.b) == (nb.avgdl, nb.k1, nb.b)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(ob.idf, nb.idf))


def test_a_broadcast_is_pickled_once_per_request_and_never_twice_to_one_transport():
    a, b = _req(1), _req(2)
    t0, t1 = object(), object()
    ia, fa = transport._shared_frame(Op.SEARCH, a, t0)
    assert transport._shared_frame(Op.SEARCH, a, t1) == (ia, fa)  # the other shard: the same bytes
    ia2, fa2 = transport._shared_frame(Op.SEARCH, a, t0)  # the same transport again: a new id
    assert ia2 != ia and _unframe(fa2)[0] == ia2
    ib, fb = transport._shared_frame(Op.SEARCH, b, t1)
    assert ib not in (ia, ia2) and _unframe(fb)[2].batch.q.tobytes() == b.batch.q.tobytes()
    ic, _ = transport._shared_frame(Op.EXACT_LISTS, b, t0)  # another op: its own frame
    assert ic != ib
    assert len({transport._frame(Op.STATS, None)[0] for _ in range(5)}) == 5


def _old_collect(replies: dict) -> dict:  # the dict the frontend built before _Carried
    into = {}
    for s, rep in replies.items():
        for f in rep.fields or ():
            for k, slot in enumerate(f.slots or ()):
                into[(s, slot)] = (f, k)
    return into


def test_carried_fields_are_found_as_the_old_dict_found_them():
    def fr(slots):
        return FetchReply([True] * len(slots), [f"d{s}" for s in slots], [""] * len(slots), [f"t{s}" for s in slots],
                          [""] * len(slots), slots)

    replies = {0: SearchReply([], [3, 3], [0.0, 0.0], fields=[fr([4, 9, 2]), fr([9, 11])]),
               1: SearchReply([], [3, 3], [0.0, 0.0], fields=[fr([4, 5]), FetchReply([], [], [], [], [], None)])}
    old, new = _old_collect(replies), _Carried()
    new.add(replies)
    for key in [(s, slot) for s in (0, 1, 2) for slot in range(13)]:
        o, n = old.get(key), new.get(key)
        assert (o is None) == (n is None), key
        if o is not None:  # the same stored fields (a slot carried twice carries the same fields)
            assert o[0].texts[o[1]] == n[0].texts[n[1]] and o[0].doc_ids[o[1]] == n[0].doc_ids[n[1]]


def test_memoised_metric_children_are_prometheus_children():
    m = Metrics()
    a = m.requests.labels(method="Retrieve", code="OK")
    assert a is m.requests.labels(method="Retrieve", code="OK")
    assert a is not m.requests.labels(method="Retrieve", code="INTERNAL")
    a.inc()
    m.stage_seconds.labels(stage="retrieve").observe(0.002)
    text = __import__("prometheus_client").generate_latest(m.registry).decode()
    assert 'oprag_requests_total{code="OK",method="Retrieve"} 1.0' in text
    assert 'oprag_stage_seconds_count{stage="retrieve"} 1.0' in text


def _old_hits(hs):  # service.convert._hits before the metadata maps were merged from cached bytes
    from oprag.v1 import oprag_pb2
    from oprag_server import metadata as md
    from oprag_server.service.convert import metadata_value

    return [oprag_pb2.Hit(chunk_id=h.chunk_id, doc_id=h.doc_id, title=h.title, text=h.text, score=h.score,
                          dense_score=h.dense_score, lexical_score=h.lexical_score, shard=h.shard,
                          metadata={k: md.as_text(v) for k, v in h.metadata.items()},
                          typed_metadata={k: metadata_value(v) for k, v in h.metadata.items()},
                          dense_rank=h.dense_rank, lexical_rank=h.lexical_rank) for h in hs]


def test_hit_messages_with_cached_metadata_bytes_equal_the_old_ones():
    import pytest

    from oprag_server.domain import Hit
    from oprag_server.service import convert

    metas = [{}, {"source": "valid.txt"}, {"a": 1}, {"a": True}, {"a": 1.0}, {"a": 0.0}, {"a": -0.0},
             {"a": 2 ** 62, "b": -(2 ** 63), "c": False, "d": "Zürich ✓", "e": 1e-300},
             {"source": "valid.txt"}, {"a": True}, {"a": 1}]  # the last three again: from the cache
    hits = [Hit(f"d{i}#0", f"d{i}", "title", "text " * i, 0.5 - i, -0.0 if i % 2 else 0.25, 0.0, i % 2, m, i, 0)
            for i, m in enumerate(metas)]
    old, new = _old_hits(hits), convert._hits(hits)
    assert old == new
    assert [m.SerializeToString(deterministic=True) for m in old] == \
        [m.SerializeToString(deterministic=True) for m in new]
    assert [new[i].typed_metadata["a"].WhichOneof("kind") for i in (2, 3, 4, 9, 10)] == \
        ["int_value", "bool_value", "float_value", "bool_value", "int_value"]
    bad = [Hit("x#0", "x", "", "", 1.0, 1.0, 0.0, 0, {"a": float("nan")})]
    with pytest.raises(convert.InvalidArgument):
        _old_hits(bad)
    with pytest.raises(convert.InvalidArgument):
        convert._hits(bad)


def test_a_retrieve_response_built_in_place_equals_the_old_one():
    from types import SimpleNamespace

    from oprag.v1 import oprag_pb2
    from oprag_server.domain import Hit
    from oprag_server.service import convert

    hits = [Hit(f"d{i}#0", f"d{i}", "t", "text", 1.0 - i, 0.5, 0.25 * i, i % 2, {"k": i, "s": "v"} if i % 2 else {}, i + 1, i)
            for i in range(10)]
    job = SimpleNamespace(hits=hits, timings_ms={"queue": 0.1, "retrieve": 5.0}, request_id="r1", info=None,
                          documents=[], memory=None, resolved_query="", trace=[], trace_spans=[])
    new = convert.retrieve_response(job, include_trace=False)
    old = oprag_pb2.RetrieveResponse(hits=_old_hits(hits), timings_ms=job.timings_ms, request_id="r1",
                                     **convert.memory_fields(job), retrieval=None, documents=[])
    assert new == old and new.SerializeToString(deterministic=True) == old.SerializeToString(deterministic=True)


def test_a_checked_reply_is_serialised_once_and_its_bytes_pass_the_serializer():
    """``_fits`` returns the reply's bytes (the size check serialised it: upb's ``ByteSize``
    serialises the whole message), and the status interceptor's serializer passes bytes through:
    the same bytes on the wire as serialising the message, one serialisation fewer."""
    from types import SimpleNamespace

    import pytest

    from oprag.v1 import oprag_pb2
    from oprag_server.config import ServerConfig
    from oprag_server.service.convert import InvalidArgument
    from oprag_server.service.interceptors import passing_bytes
    from oprag_server.service.servicer import OpRAGServicer

    msg = oprag_pb2.RetrieveResponse(hits=[oprag_pb2.Hit(chunk_id=f"c{i}", text="x" * 900, score=1.0 / (i + 1))
                                           for i in range(10)], timings_ms={"retrieve": 1.5}, request_id="r")
    sv = OpRAGServicer.__new__(OpRAGServicer)
    sv.cfg = ServerConfig()
    raw = sv._fits(msg, SimpleNamespace(top_k=10))
    assert type(raw) is bytes and raw == msg.SerializeToString()
    ser = passing_bytes(oprag_pb2.RetrieveResponse.SerializeToString)
    assert ser(raw) is raw and ser(msg) == raw and passing_bytes(None) is None
    assert oprag_pb2.RetrieveResponse.FromString(raw) == msg
    sv.cfg = SimpleNamespace(limits=SimpleNamespace(max_message_bytes=len(raw) - 1),
                             retrieval=SimpleNamespace(default_top_k=10))
    with pytest.raises(InvalidArgument, match=f"would be {len(raw)} bytes"):
        sv._fits(msg, SimpleNamespace(top_k=10))
