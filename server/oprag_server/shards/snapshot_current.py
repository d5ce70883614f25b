"""Which snapshot directory a shard's start loads, and the start's warnings (:mod:`.snapshot`)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Callable

from ..index.wal import fsync_write

#: a line for the service log (:meth:`.state.ShardState.say`), or None: nothing is logged
Say = Callable[..., None] | None


def current(d: Path, say: Say) -> Path | None:
    """The snapshot directory a start loads: the one ``CURRENT`` names; without ``CURRENT``, ``d`` itself when it holds
    a ``meta.json`` (the first layout), else the newest ``snap-*`` directory written whole (``meta.json`` is its last
    file): one a crash left just before ``CURRENT`` named it (its log records are all still in the log, so loading it
    and replaying them is the same state), or one whose ``CURRENT`` was lost. Without this, a lost ``CURRENT`` started
    the shard empty and the start's sweep removed its snapshot (trial55). None: no snapshot."""
    cur = d / "CURRENT"
    if cur.exists():
        name = cur.read_bytes().decode("utf-8", "replace").strip()
        if not name.startswith("snap-") or "/" in name or not (d / name).is_dir():
            raise RuntimeError(f"{cur} names {name!r}, which is not a snapshot directory here: write the name of the "
                               f"snapshot directory to load into it (snap-...), or remove it to load the newest whole one")
        return d / name
    if (d / "meta.json").exists():
        return d
    whole = sorted((_applied(p), p.name) for p in d.glob("snap-*") if (p / "meta.json").is_file())
    if whole:
        warn(say, f"{cur} is missing: loading {whole[-1][1]}, the newest snapshot directory written whole")
    return d / whole[-1][1] if whole else None


def _applied(snap: Path) -> int:
    """The ``applied_seq`` ``snap/meta.json`` records (-1 when it cannot be read): what orders the snapshot
    directories, not their names (a directory renamed or copied in keeps its own)."""
    try:
        return int(json.loads((snap / "meta.json").read_text()).get("applied_seq", -1))
    except (OSError, ValueError, AttributeError, TypeError):
        return -1


def warn(say: Say, line: str) -> None:
    """``say(line)`` at level WARNING where ``say`` takes a level (:meth:`.state.ShardState.say`)."""
    if say is not None:
        try:
            say(line, "WARNING")
        except TypeError:
            say(line)


def meta_crc(meta: dict) -> int:
    """CRC-32 of ``meta.json``'s fields but ``crc32`` itself, as canonical JSON (sorted keys)."""
    return zlib.crc32(json.dumps({k: v for k, v in meta.items() if k != "crc32"}, sort_keys=True).encode())


def read_meta(snap: Path) -> dict:
    """``snap/meta.json``, its CRC-32 checked when it has one (snapshots before it have none).

    :raises RuntimeError: it cannot be read or parsed, or its CRC-32 does not match (named)."""
    try:
        meta = json.loads((snap / "meta.json").read_text())
        if "crc32" in meta and meta["crc32"] != meta_crc(meta):
            raise ValueError("its CRC-32 does not match its fields (the file is damaged)")
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise RuntimeError(f"{snap / 'meta.json'} cannot be read ({exc}): restore the snapshot directory from a "
                           f"backup") from exc
    return meta


def write_meta(snap: Path, meta: dict) -> None:
    """Write ``snap/meta.json`` with ``meta``'s fields and their CRC-32 (a flipped digit of a number still parses),
    fsync'ed, atomically. :raises OSError:"""
    fields = {k: v for k, v in meta.items() if k != "crc32"}
    fsync_write(snap / "meta.json", json.dumps({**fields, "crc32": meta_crc(fields)}).encode())
