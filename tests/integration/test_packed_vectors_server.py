"""Packed own vectors on a real server (2 shard processes): numpy vectors travel as
``vectors_f32``, are stored and found like the repeated-float form; a wrong byte length or
width is INVALID_ARGUMENT and nothing of the stream is stored."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, OpRAGClient
from oprag_client.testing import ServerProcess

pytestmark = pytest.mark.integration


def test_packed_vectors_round_trip_and_rejects(tmp_path):
    rng = np.random.default_rng(11)
    V = rng.standard_normal((60, 384)).astype(np.float32)
    docs = [Doc(f"p{i}", f"packed note {i} about subject {i % 4}", vector=V[i]) for i in range(40)]
    docs.append(Doc("c", chunks=[(f"chunk {j} of c", V[40 + j]) for j in range(3)]))
    docs.append(Doc("f", "float form", vector=V[50].tolist()))
    srv = ServerProcess.on_free_ports(tmp_path, "--generator", "none", "--shards", "2")
    srv.start()
    try:
        with OpRAGClient(srv.target, timeout=120) as c:
            c.ingest(docs)
            assert c.stats().chunks == 44
            for i in (3, 41, 50):
                top = c.retrieve("note", mode="dense", top_k=1, query_vector=V[i].tolist()).hits[0]
                want = {3: "p3#0", 41: "c#1", 50: "f#0"}[i]
                assert top.chunk_id == want and top.dense_score == pytest.approx(1.0, abs=1e-5)
            bad = [oprag_pb2.Document(id="ok", text="fine", vectors_f32=V[0].tobytes(), vector_dim=384),
                   oprag_pb2.Document(id="short", text="t", vectors_f32=V[0].tobytes()[:-4], vector_dim=384)]
            wide = [oprag_pb2.Document(id="w", text="t", vectors_f32=V[0].tobytes(), vector_dim=192,
                                       chunks=[])]
            for stream in (bad, wide):
                with pytest.raises(grpc.RpcError) as err:
                    c.ingest(stream)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert c.stats().chunks == 44  # nothing of the failed streams stored
    finally:
        srv.stop()
