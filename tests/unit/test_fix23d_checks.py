"""trial23 #3 and nits, the checks themselves (tests/integration/test_fix23d.py runs them over a
served request): a never-issued ``min_seq`` names ``min_seq`` (HTTP ``param``), an all-whitespace
document id is refused like an empty one, a filter key over 1024 bytes of UTF-8 is refused."""

import asyncio

import pytest

from oprag.v1 import oprag_pb2
from oprag_server.config import ServerConfig
from oprag_server.engine.documents import validate_document
from oprag_server.service import convert
from oprag_server.service.convert import InvalidArgument
from oprag_server.service.openai_errors import error_param
from oprag_server.service.servicer import read_your_writes

LIM = ServerConfig().limits


class _Runtime:
    async def wait_applied(self, seq, timeout):
        raise LookupError(f"sequence number {seq} was never issued (the latest is 4)")


def test_min_seq_never_issued_names_min_seq():
    with pytest.raises(InvalidArgument) as ei:
        asyncio.run(read_your_writes(_Runtime(), 1000, None))
    msg = str(ei.value)
    assert msg.startswith("min_seq is too large: sequence number 1000 was never issued (the latest is 4)"), msg
    assert error_param(msg, "/v1/retrieve") == "min_seq"
    assert error_param(msg, "/v1/chat/completions") == "oprag.min_seq"


@pytest.mark.parametrize("doc_id", [" ", "   ", "\t\n", "\u3000"])
def test_an_all_whitespace_document_id_is_refused(doc_id):
    doc = oprag_pb2.Document(id=doc_id, text="zebra")
    assert validate_document(doc, LIM) == "id is only whitespace: give every document an id with a character other than whitespace"
    with pytest.raises(InvalidArgument, match="all-whitespace id"):
        convert.delete_ids(oprag_pb2.DeleteRequest(doc_ids=["a", doc_id]), LIM)


@pytest.mark.parametrize("doc_id", [" a", "a b", "b ", "nl\nid", "tab\tand\x01"])
def test_an_id_with_other_characters_is_kept(doc_id):
    assert validate_document(oprag_pb2.Document(id=doc_id, text="zebra"), LIM) is None
    assert convert.delete_ids(oprag_pb2.DeleteRequest(doc_ids=[doc_id]), LIM) == [doc_id]


def test_a_filter_key_over_1024_bytes_is_refused():
    ok = convert.filters([oprag_pb2.MetadataFilter(key="k" * 1024, values=["v"])])
    assert ok == (("k" * 1024, ("v",)),)
    for key in ("k" * 1025, "é" * 513, "k" * 100_000):
        with pytest.raises(InvalidArgument) as ei:
            convert.filters([oprag_pb2.MetadataFilter(key=key, values=["v"])])
        msg = str(ei.value)
        assert msg.startswith(f"a metadata filter key is {len(key.encode())} bytes of UTF-8; the limit is 1024"), msg
        assert len(msg) < 200 and error_param(msg, "/v1/retrieve") == "filters"


def test_an_id_with_nul_is_refused_saying_what_to_change():
    """trial49 #3: the reason said only that the id held a NUL, not what to do, nor that a newline is kept."""
    got = validate_document(oprag_pb2.Document(id="nl\nid\x00x", text="zebra"), LIM)
    assert got == "id contains a NUL character (U+0000): remove it (any other character, control characters included, is kept)"
