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
    assert validate_document(doc, LIM) == ("chunk 1's text is empty (nothing but whitespace, control or invisible "
                                           "characters; chunks counted from 0 in the document's order)")  # (trial50b)


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


def test_a_folder_s_dangling_link_and_fifo_are_skipped_with_a_message(tmp_path, capsys):
    """trial24: ``oprag ingest --format text <folder>`` skipped a dangling symbolic link and a FIFO
    silently, while a non-UTF-8 file is skipped with a message."""
    import os

    from oprag_client.loaders import load_parquet, load_text

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "good.txt").write_text("zebra crossing")
    (tmp_path / "a" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    os.symlink(tmp_path / "nonexistent", tmp_path / "a" / "dangling.txt")
    os.mkfifo(tmp_path / "a" / "fifo.txt")
    os.symlink(tmp_path / "a" / "good.txt", tmp_path / "a" / "link.md")  # a link to a file is read
    (tmp_path / "a" / "dir.txt").mkdir()  # a folder named like a text file: walked, not a file
    os.mkfifo(tmp_path / "a" / "fifo.log")  # not a text suffix: not looked at
    docs = list(load_text([tmp_path]))
    assert [d.id for d in docs] == ["a/good.txt", "a/link.md"]
    err = capsys.readouterr().err.splitlines()
    assert sorted(err) == sorted([
        f"oprag: skipping {tmp_path}/a/dangling.txt: a symbolic link to {tmp_path}/nonexistent, which does not exist",
        f"oprag: skipping {tmp_path}/a/fifo.txt: a FIFO, not a regular file",
        f"oprag: skipping {tmp_path}/a/latin1.txt: not UTF-8"]), err
    os.mkfifo(tmp_path / "a" / "p.parquet")  # the parquet / arrow folder walk says so too
    assert list(load_parquet([tmp_path / "a"])) == []
    assert capsys.readouterr().err == f"oprag: skipping {tmp_path}/a/p.parquet: a FIFO, not a regular file\n"


def test_oversized_metadata_says_what_to_do():
    """trial29 #7: the reason said only "metadata is N bytes; the limit is 16384"."""
    doc = oprag_pb2.Document(id="d", text="zebra", metadata={"k": "v" * (LIM.max_metadata_bytes + 10)})
    reason = validate_document(doc, LIM)
    assert reason.startswith(f"metadata is {LIM.max_metadata_bytes + 11} bytes (keys and values); the limit is "
                             f"{LIM.max_metadata_bytes}: shorten or drop values"), reason
