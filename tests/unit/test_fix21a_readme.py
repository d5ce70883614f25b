"""README's WikiText-2 figures are what the code produces (trial21: the README said 1,355 chunks,
`oprag ingest --format wikitext .../valid.txt` wrote 1,356). The chunks are counted as the
ingest path makes them (the loader's articles, the server's Chunker at the default size over
MiniLM's tokenizer: engine/ingest.py), without embedding; 60 articles, 1,356 chunks, the same as
that ingest's summary on a server (2026-12-03)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the project's shared/ folder lies beside the repository (OPRAG_WIKITEXT overrides)
WIKITEXT = Path(os.environ.get("OPRAG_WIKITEXT") or ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt")


def test_readme_wikitext_chunk_count_is_what_ingest_makes():
    if not WIKITEXT.is_file():
        pytest.skip(f"{WIKITEXT} not present (set OPRAG_WIKITEXT)")
    from oprag_client.loaders import load_wikitext
    from oprag_server.config import ChunkingConfig
    from oprag_server.models.encoder import resolve_encoder_path
    from oprag_server.operators.chunking import Chunker

    m = re.search(r"the WikiText-2 file \((?:(\d+) articles, )?([\d,]+) chunks\)", (ROOT / "README.md").read_text())
    assert m, "README no longer gives the WikiText-2 chunk count"
    cfg = ChunkingConfig()
    chunker = Chunker.for_model(resolve_encoder_path("minilm"), 256, cfg.size, cfg.overlap)
    docs = list(load_wikitext([WIKITEXT]))
    chunks = sum(len(chunker.chunks(d.text)) for d in docs)
    assert (m.group(1), m.group(2)) == (str(len(docs)), f"{chunks:,}")
