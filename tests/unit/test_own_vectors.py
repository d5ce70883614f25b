"""Bring your own vectors: documents that carry their chunk embeddings are neither chunked nor
embedded; the vectors are checked (width, NaN/infinity, zeros) and L2-normalised; the client
and the JSON-lines loader carry them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oprag.v1 import oprag_pb2
from oprag_client.client import Doc, _as_pb
from oprag_client.loaders import load_jsonl
from oprag_server import records
from oprag_server.config import ChunkingConfig, IngestConfig, LimitsConfig
from oprag_server.engine.documents import IngestError, supplied_vectors, validate_document
from oprag_server.engine.ingest import IngestPipeline, IngestResult, _Doc
from oprag_server.models.fakes import HashingEncoder
from oprag_server.service.metrics import Metrics

D = 8


def test_unit_rows_normalises_and_scales():
    v = records.unit_rows([[3.0, 4.0] + [0.0] * (D - 2), [1e-30] * D, [1e30] * D], D)
    assert v.dtype == np.float32 and v.shape == (3, D)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(v[0, :2], [0.6, 0.8], rtol=1e-6)


@pytest.mark.parametrize("row, msg", [([1.0] * (D - 1), "width 8"), ([np.nan] + [1.0] * (D - 1), "NaN"),
                                      ([np.inf] + [1.0] * (D - 1), "NaN or infinity"),
                                      ([0.0] * D, "all zeros .*: send the chunk.s embedding, or leave the vector out")])
def test_unit_rows_rejects(row, msg):
    with pytest.raises(ValueError, match=msg):
        records.unit_rows([row], D)


def test_supplied_vectors_of_one_vector_and_of_chunks():
    one = Doc("a", "whole text", vector=[1.0] * D).to_pb()
    got = supplied_vectors(0, one, D)
    assert [t for t, _ in got] == ["whole text"]
    np.testing.assert_allclose(got[0][1], np.full(D, 1 / np.sqrt(D)), rtol=1e-6)
    many = Doc("b", chunks=[("first", [1.0] + [0.0] * (D - 1)), ("second", [0.0, 2.0] + [0.0] * (D - 2))]).to_pb()
    got = supplied_vectors(0, many, D)
    assert [t for t, _ in got] == ["first", "second"] and got[1][1][1] == 1.0
    assert supplied_vectors(0, Doc("c", "embed me").to_pb(), D) is None


def test_wrong_width_fails_the_stream():
    with pytest.raises(IngestError, match="document 3 .*width 8.*nothing was stored"):
        supplied_vectors(3, Doc("a", "t", vector=[1.0] * (D + 1)).to_pb(), D)


def test_validation_of_documents_with_chunks():
    lim = LimitsConfig()
    assert validate_document(Doc("a", chunks=[("x", [1.0] * D)]).to_pb(), lim) is None
    assert "leave text and vector empty" in validate_document(Doc("a", "also text", chunks=[("x", [1.0] * D)]).to_pb(), lim)
    assert "chunk 0's text is empty" in validate_document(Doc("a", chunks=[(" \u200b", [1.0] * D)]).to_pb(), lim)


def test_transform_keeps_supplied_chunks_and_embeds_nothing_for_them():
    enc = HashingEncoder(dim=D)
    p = IngestPipeline(encoder=enc, pool=None, commit=None, chunking=ChunkingConfig(), cfg=IngestConfig(),
                       limits=LimitsConfig(), embedder=None, metrics=Metrics(), next_generation=lambda: 1)
    v = records.unit_rows([[1.0] * enc.dim, [2.0] + [1.0] * (enc.dim - 1)], enc.dim)
    own = _Doc(0, "own", "", "", {}, 1, [("alpha text", v[0]), ("beta text", v[1])])
    plain = _Doc(1, "plain", "", "gamma text to embed", {}, 1)
    chunks = p._transform([own, plain], IngestResult())
    mine = [c for c in chunks if c.doc is own]
    assert [(c.ordinal, c.text) for c in mine] == [(0, "alpha text"), (1, "beta text")]
    assert all(c.vector is not None and c.ids == [] for c in mine)
    assert [c.vector is None for c in chunks if c.doc is plain] == [True]


def test_client_dict_and_jsonl_carry_vectors(tmp_path):
    pb = _as_pb({"id": "d", "chunks": [{"text": "t1", "vector": [0.5] * D}]})
    assert isinstance(pb, oprag_pb2.Document) and pb.text == "" and list(pb.chunks[0].vector) == [0.5] * D
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"id": "1", "text": "one", "vector": [1.0] * D}) + "\n"
                 + json.dumps({"id": "2", "chunks": [{"text": "c", "vector": [2.0] * D}]}) + "\n")
    docs = list(load_jsonl([f]))
    assert docs[0].vector == [1.0] * D and docs[0].text == "one"
    assert docs[1].chunks == [("c", [2.0] * D)] and docs[1].text == ""
    assert list(docs[1].to_pb().chunks[0].vector) == [2.0] * D
