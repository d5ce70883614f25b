"""Time of ``Chunker.spans`` against one document's size (issue: chunking was superlinear).

Builds the chunker as the server does (:meth:`Chunker.for_model` over the MiniLM directory,
``--chunk-size`` 256) and times ``spans`` on synthetic documents of ``--sizes`` characters:

* ``para``: one paragraph of sentences of random made-up words (seeded),
* ``wiki1``: WikiText-2 ``valid.txt`` with every newline run replaced by a space, repeated (one paragraph),
* ``paras``: ``para`` with a paragraph break every 6 sentences,
* ``wiki``: WikiText-2 ``valid.txt`` as it is (paragraphs and lines), repeated,
* ``word``: one giant word of random letters (no whitespace at all),
* ``cjk``: random CJK ideographs without spaces, a ``。`` every ~30 characters,
* ``cjk0``: random CJK ideographs, no punctuation, no spaces.

Run from the repository root, the server package on ``PYTHONPATH`` (which code is timed is
whatever ``oprag_server`` that path holds, so an old checkout can be timed side by side)::

    python -m bench.chunk_scale --sizes 65536,262144,1048576 --kinds para,paras --json

Prints one line per (kind, size): seconds, characters per second, chunks; ``--json`` adds one
JSON line at the end. ``--check`` also verifies the module docstring's invariants on each result.

``--serve-chars N`` instead ingests one ``para`` document of N characters (one paragraph, with a
unique marker word every ~2,000 characters) into a real server (``--generator none``) with a
600 s deadline, and checks that it is acknowledged with as many chunks as the chunker gives and
that a lexical search for each of 40 sampled markers finds the chunk holding it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

# the project's shared/ folder beside the repository (or beside its worktree folder); OPRAG_WIKITEXT overrides
_CANDIDATES = [Path(__file__).resolve().parents[k] / "shared" / "data" / "wikitext-2" / "valid.txt" for k in (1, 2, 3)]
WIKI = Path(os.environ.get("OPRAG_WIKITEXT") or next((p for p in _CANDIDATES if p.exists()), "valid.txt"))
KINDS = ("para", "wiki1", "paras", "wiki", "word", "cjk", "cjk0")


def _words(rng: random.Random, n: int) -> list[str]:
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    return ["".join(rng.choice(letters[: 8 + k % 18]) for _ in range(rng.randint(1, 11))) for k in range(n)]


def make_text(kind: str, n: int, seed: int = 0) -> str:
    """A synthetic document of exactly ``n`` characters (code points) of the given kind."""
    rng = random.Random(f"{kind}:{n}:{seed}")
    if kind in ("para", "paras"):
        vocab = _words(rng, 3000)
        out, size, k = [], 0, 0
        while size < n:
            s = " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 30)))
            s = s[0].upper() + s[1:] + rng.choice(".?!") + ("\n\n" if kind == "paras" and k % 6 == 5 else " ")
            out.append(s)
            size += len(s)
            k += 1
        return "".join(out)[:n]
    if kind in ("wiki", "wiki1"):
        base = WIKI.read_text(encoding="utf-8")
        if kind == "wiki1":
            base = re.sub(r"\s*\n\s*", " ", base)
        start = rng.randrange(len(base) // 2)
        base = base[start:] + base[:start]
        return (base * (n // len(base) + 1))[:n]
    if kind == "word":
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
    if kind in ("cjk", "cjk0"):
        chars = [chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(n)]
        if kind == "cjk":
            for i in range(rng.randint(10, 50), n, 30):
                chars[i] = "。"
        return "".join(chars)
    raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")


def check(chunker, text: str, spans) -> None:
    """The module docstring's invariants (overlap 0)."""
    pos = 0
    for start, c in spans:
        assert c and c == c.strip(), "empty or untrimmed chunk"
        assert text[start:start + len(c)] == c, "not a substring"
        assert start >= pos and not text[pos:start].strip(), "non-whitespace between chunks"
        pos = start + len(c)
    assert not text[pos:].strip()


def serve(n: int) -> dict:
    """End-to-end: one ``n``-character single-paragraph document through a real server."""
    import tempfile

    from oprag_client.client import Doc, OpRAGClient
    from oprag_server.models.encoder import resolve_encoder_path
    from oprag_server.operators.chunking import Chunker

    from ._common import start_server

    words = make_text("para", n).split(" ")
    step = max(1, len(words) // (n // 2000))
    markers = {}
    for k, i in enumerate(range(0, len(words), step)):
        words[i] = markers[i] = f"zqx{k:05d}marker"
    text = " ".join(words)
    expect = Chunker.for_model(resolve_encoder_path("minilm"), 256, 256).chunks(text)
    with tempfile.TemporaryDirectory() as d:
        srv = start_server(Path(d), "--generator", "none")
        try:
            with OpRAGClient(srv.target, timeout=600) as c:
                t0 = time.perf_counter()
                r = c.ingest([Doc("big", text)], timeout=600)
                took = time.perf_counter() - t0
                rng = random.Random(1)
                sample = rng.sample(sorted(markers.values()), min(40, len(markers)))
                found = 0
                for m in sample:
                    hits = c.retrieve(m, top_k=3, mode="lexical").hits
                    found += any(m in h.text.split() for h in hits)
        finally:
            srv.stop()
    out = {"chars": len(text), "bytes": len(text.encode()), "ingest_s": round(took, 1),
           "chunks_written": r.chunks_written, "chunks_expected": len(expect), "chunks_split": r.chunks_split,
           "markers_found": found, "markers_sampled": len(sample)}
    print(out, file=sys.stderr)
    assert r.documents_written == 1 and r.chunks_written == len(expect) and found == len(sample), out
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="65536,262144,1048576")
    ap.add_argument("--kinds", default="para,paras")
    ap.add_argument("--size", type=int, default=256, help="chunk size in tokens (server default 256)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve-chars", type=int, default=0, help="end-to-end through a real server instead")
    a = ap.parse_args(argv)
    if a.serve_chars:
        out = serve(a.serve_chars)
        if a.json:
            print(json.dumps({"bench": "chunk_scale.serve", **out}))
        return 0
    from oprag_server.models.encoder import resolve_encoder_path
    from oprag_server.operators import chunking

    chunker = chunking.Chunker.for_model(resolve_encoder_path("minilm"), 256, a.size)
    rows = []
    for kind in a.kinds.split(","):
        for n in (int(s) for s in a.sizes.split(",")):
            text = make_text(kind, n)
            for _ in range(a.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                spans = chunker.spans(text)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                rows.append({"kind": kind, "chars": n, "s": round(wall, 3), "cpu_s": round(cpu, 3),
                             "chunks": len(spans), "src": chunking.__file__})
                print(f"{kind:6s} {n:>9,d} chars  {wall:8.3f} s  cpu {cpu:8.3f} s  "
                      f"{n / max(wall, 1e-9) / 1e3:8.1f} Kchar/s  {len(spans):6d} chunks", file=sys.stderr, flush=True)
            if a.check:
                check(chunker, text, spans)
    if a.json:
        print(json.dumps({"bench": "chunk_scale", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
