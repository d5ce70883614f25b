"""``oprag salvage-log PATH...``: the operator's step past a refused start over a damaged log.

A start refuses when intact records follow a damaged span of a write-ahead log (a shard's
``wal.log``, the frontend's ``commits.log``): :class:`~.index.wal.LogDamaged`, the file left as
it is. This command rewrites each named log with every intact record, in order, without the
damaged spans (:func:`~.index.wal.salvage`), and keeps the original beside it as
``<name>.damaged``. A ``commits.log`` (also a missing or emptied one) also gets back the commit
records that the shards' logs beside it prove (:func:`~.engine.commit_repair.salvage_commits`;
``--with-last`` for the last prepared transaction, which no log can prove). It holds the data directory's lock meanwhile, so it refuses while a server
runs on it. The records inside a damaged span are lost; the next start still refuses when one of
them was a committed write that a shard's log lacks (:meth:`.shards.txn.Transactions.replay`,
:meth:`.engine.commit.CommitProtocol.check_recovered`), and says so.

Exit status: 0 every log was read (salvaged or found intact), 2 a path is missing, not a file,
in a data directory in use, or could not be rewritten (the reason on stderr).

``oprag salvage-memory SHARD_DIR...`` (:func:`memory_main`) is the step past a start refused over a
shard's damaged session memory (``memory.json``, ``memory_vectors.npy``, which have no other copy):
the shard starts without the snapshot's session turns, its documents kept (:func:`.shards.memory_files.salvage`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser(prog: str = "oprag salvage-log") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Rewrite damaged OpRAG write-ahead logs (wal.log, "
                                 "commits.log) with their intact records; the original is kept as <name>.damaged. "
                                 "Stop the server first.")
    ap.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="a log file named in the refusal")
    ap.add_argument("--with-last", action="store_true",
                    help="commits.log: also restore the commit record of the last transaction every shard prepared, "
                         "when no record says whether it was committed")
    return ap


def _data_dir(p: Path) -> Path | None:
    """The nearest directory above ``p`` that a server locks (it holds ``.lock``), or None."""
    for d in p.resolve().parents:
        if (d / ".lock").exists():
            return d
    return None


def _lock_above(p: Path, locks: dict) -> None:
    """Lock the data directory above ``p`` (:func:`_data_dir`) unless ``locks`` holds it already.
    :raises RuntimeError: a server runs on it."""
    from .startup import lock_data_dir

    d = _data_dir(p)
    if d is not None and d not in locks:
        locks[d] = lock_data_dir(d)


def main(argv: list[str] | None = None) -> int:
    """:returns: the exit status (module docstring)."""
    from .engine.commit_repair import salvage_commits
    from .index.wal import salvage

    a = build_parser().parse_args(argv)
    status, locks = 0, {}
    for p in a.paths:
        commits = p.name == "commits.log"  # (rebuilt from the shards' logs beside it, also when missing)
        try:
            if not p.is_file() and not (commits and p.parent.is_dir() and not p.exists()):
                raise OSError(f"{p}: no such log file")
            _lock_above(p, locks)
            if commits:
                print("\n".join(salvage_commits(p, a.with_last)))
                continue
            kept, spans, orig = salvage(p)
        except (OSError, RuntimeError) as exc:
            print(f"oprag salvage-log: {exc}", file=sys.stderr)
            status = 2
            continue
        if not spans:
            print(f"{p}: intact ({kept} records); not changed")
            continue
        lost = sum(e - s for s, e in spans)
        where = ", ".join(f"{s}-{e}" for s, e in spans)
        print(f"{p}: kept {kept} intact records; dropped {len(spans)} damaged spans ({lost} bytes at {where}); "
              f"the original is {orig}")
    for f in locks.values():
        f.close()
    return status


def memory_main(argv: list[str] | None = None) -> int:
    """``oprag salvage-memory SHARD_DIR...``. :returns: 0 each shard's memory loads or was given up,
    2 a directory has no readable snapshot, is in a data directory in use, or could not be rewritten."""
    from .shards.memory_files import salvage as salvage_memory

    ap = argparse.ArgumentParser(prog="oprag salvage-memory", description="Start a shard without the session memory "
                                 "of its snapshot when that cannot be read (memory.json, memory_vectors.npy): the "
                                 "files are kept as <name>.damaged, the documents are not touched. Stop the server "
                                 "first.")
    ap.add_argument("dirs", nargs="+", type=Path, metavar="SHARD_DIR", help="a shard directory (<data-dir>/shard-<i>)")
    a = ap.parse_args(argv)
    status, locks = 0, {}
    for d in a.dirs:
        try:
            if not d.is_dir():
                raise OSError(f"{d}: no such directory")
            _lock_above(d, locks)  # (the data directory above the shard's)
            print(salvage_memory(d))
        except (OSError, RuntimeError) as exc:
            print(f"oprag salvage-memory: {exc}", file=sys.stderr)
            status = 2
    for f in locks.values():
        f.close()
    return status
