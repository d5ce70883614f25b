"""``Doc.to_pb`` time with the client's vector check of a base commit vs this tree's, side by
side in one process (alternating rounds): 1,000 documents x 384 floats, as Python lists and as
numpy float32 arrays (fix22b: every list element is checked for booleans, not only the ends).

    PYTHONPATH=server:client:. python bench/vector_check.py [--base 1897d61] [--rounds 15]

Prints per input kind the median ms per 1,000 documents (or vectors: ``floats()`` alone, the
check itself) of each side and their ratio (new / old).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from oprag_client import client
from oprag_client import vectors as new


def _old_vectors(base: str):
    """The base commit's ``oprag_client/vectors.py`` as a module."""
    src = subprocess.run(["git", "show", f"{base}:client/oprag_client/vectors.py"], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "old_vectors.py"
    path.write_text(src, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("old_vectors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time(docs, floats) -> float:
    """ms for ``to_pb`` of every document (``docs``), or for ``floats`` of every vector (a list
    of vectors) with ``client._floats`` = ``floats``."""
    client._floats = floats
    t0 = time.perf_counter()
    if isinstance(docs[0], client.Doc):
        for d in docs:
            d.to_pb()
    else:
        for v in docs:
            floats(v, "v")
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="1897d61")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=384)
    a = ap.parse_args()
    old = _old_vectors(a.base)
    rng = np.random.default_rng(0)
    m = rng.standard_normal((a.docs, a.dim)).astype(np.float32)
    text = "A short chunk of text about tides and harbours. " * 4
    kinds = {
        "list of float": [client.Doc(f"d{i}", text, vector=m[i].astype(float).tolist()) for i in range(a.docs)],
        "numpy float32": [client.Doc(f"d{i}", text, vector=m[i]) for i in range(a.docs)],
        "floats() alone, lists": [m[i].astype(float).tolist() for i in range(a.docs)],
        "4 chunks, lists": [client.Doc(f"d{i}", chunks=[(text, m[(i + j) % a.docs].astype(float).tolist()) for j in range(4)])
                            for i in range(a.docs // 4)],
    }
    print(f"load average {os.getloadavg()}, python {sys.version.split()[0]}, {a.docs} docs x {a.dim}")
    for name, docs in kinds.items():
        times = {"old": [], "new": []}
        for r in range(a.rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[side].append(_time(docs, (old if side == "old" else new).floats))
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{name:22s} old {o:7.2f} ms  new {n:7.2f} ms  new/old {n / o:.2f}  (per {len(docs)} docs; "
              f"min old {min(times['old']):.2f}, new {min(times['new']):.2f})")
    client._floats = new.floats
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
