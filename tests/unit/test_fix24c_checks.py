"""trial24 nits, the checks themselves: a document text (or chunk text) of only control
characters is empty, as one of only whitespace and invisible characters is."""

from __future__ import annotations

import pytest

from oprag.v1 import oprag_pb2
from oprag_server.config import ServerConfig
from oprag_server.engine.documents import validate_document

LIM = ServerConfig().limits
EMPTY = "text is empty (nothing but whitespace, control or invisible characters): send the document's text"


@pytest.mark.parametrize("text", ["\x00\x01\x02", "\x00", "\x7f\x1b\t\x00", "\x85\u200b\x9f", "\u200b\u2060\ufeff", " \n"])
def test_a_text_of_only_control_whitespace_or_invisible_characters_is_empty(text):
    assert validate_document(oprag_pb2.Document(id="d", text=text), LIM) == EMPTY


def test_a_chunk_of_only_control_characters_is_empty():
    doc = oprag_pb2.Document(id="d", chunks=[oprag_pb2.ChunkVector(text="zebra"), oprag_pb2.ChunkVector(text="\x00\x01")])
    assert validate_document(doc, LIM) == "a chunk's text is empty (nothing but whitespace, control or invisible characters)"


@pytest.mark.parametrize("text", ["\x00zebra", "a\x01", "\x9f\u00e9"])
def test_a_text_with_a_visible_character_beside_control_characters_is_kept(text):
    assert validate_document(oprag_pb2.Document(id="d", text=text), LIM) is None


@pytest.mark.parametrize("argv,usage", [
    (["query", "--bogus", "cells"], "usage: oprag query "),
    (["stats", "--bogus"], "usage: oprag stats "),
    (["ingest", "--bogus", "x"], "usage: oprag ingest "),
    (["delete", "a", "--bogus"], "usage: oprag delete "),
    (["eval", "beir", "--queries", "q", "--qrels", "r", "--bogus"], "usage: oprag eval beir "),
])
def test_an_unknown_option_of_a_subcommand_shows_that_subcommands_usage(argv, usage, capsys):
    """trial24: argparse handed a subcommand's unknown option to the top-level parser, which
    printed ``usage: oprag [-h] {serve,ingest,...}``."""
    from oprag_client.cli import main

    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2
    assert err.startswith(usage), err
    prog = usage.removeprefix("usage: ").strip()  # "oprag query"
    assert err.rstrip().splitlines()[-1] == f"{prog}: error: unrecognized arguments: --bogus", err
