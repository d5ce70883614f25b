"""What the shards' write-ahead logs prove about lost commit records (trial56 F1-F3).

Commits run one at a time, every shard prepares every transaction (a prepare record in its
``wal.log``) before the frontend appends the commit record, and a number is committed, given back
(its transaction aborted: the next one takes it) or recorded as skipped (a skip record,
``{"txn": "", "kind": "skip", "skipped": [...]}``, appended before the next number is prepared). So for every number ``n`` below the
highest one the shards prepared, the transaction committed at ``n`` is the last one every shard
prepared at ``n``; the highest one may have been committed or cut short by a crash, and only its
commit record can say which.

Used by a start (:meth:`.commit.CommitProtocol.open_log`: a damaged last commit record that is
a prepared transaction's) and by ``oprag salvage-log <data-dir>/commits.log``
(:func:`salvage_commits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..index.wal import encode_record, fsync_write, keep_original, parse_spans


def shard_logs(data_dir: Path) -> dict[Path, list[tuple[str, int]]]:
    """``{wal.log: [(txn, seq) of its prepare records, in log order]}`` of every shard (and
    replica) directory under ``data_dir``, damaged spans skipped. :raises OSError: unreadable."""
    out = {}
    for wal in sorted(Path(data_dir).glob("**/shard-*/wal.log")):
        out[wal] = [(r["txn"], int(r["seq"])) for r in parse_spans(wal.read_bytes())[0]
                    if r.get("kind") in ("upsert", "delete")]
    return out


@dataclass
class Proof:
    """What the shards' logs say about the numbers a commit log lacks (:func:`prove`)."""

    restore: dict[int, str] = field(default_factory=dict)  # number -> the transaction committed there
    last: tuple[int, str] | None = None  # the highest prepared number, not in the log: committed or cut short
    unclear: list[int] = field(default_factory=list)  # numbers whose last prepared transaction differs between logs


def prove(records: list[dict], logs: dict[Path, list[tuple[str, int]]]) -> Proof:
    """The commit records ``records`` (a commit log's, base and skipped numbers included) lack,
    from the shards' prepare records ``logs`` (:func:`shard_logs`)."""
    done = {int(r["seq"]) for r in records} | {int(n) for r in records for n in r.get("skipped", ())}
    floor = max([int(r["seq"]) for r in records if r.get("kind") == "base"] + [0])  # (snapshots reached it)
    last_at: dict[int, set[str]] = {}
    for ops in logs.values():
        mine: dict[int, str] = {}
        for txn, seq in ops:
            mine[seq] = txn  # (log order: the last one prepared at that number)
        for seq, txn in mine.items():
            last_at.setdefault(seq, set()).add(txn)
    top = max(last_at, default=0)
    out = Proof()
    for seq in sorted(n for n in last_at if n > floor and n not in done):
        txns = last_at[seq]
        if len(txns) != 1:
            out.unclear.append(seq)
        elif seq == top:
            out.last = (seq, next(iter(txns)))
        else:
            out.restore[seq] = next(iter(txns))
    return out


def tail_is(torn: bytes, seq: int, txn: str) -> bool:
    """Whether the torn tail ``torn`` of a commit log is the whole commit record of ``txn`` at
    ``seq`` with a few bytes changed (damaged after it was written), not one cut short."""
    want = encode_record({"txn": txn, "seq": seq})
    if len(torn) != len(want):
        return False
    if torn[8:] == want[8:]:  # the payload whole: the damage is in the length or the CRC-32
        return True
    # the CRC-32 stored is that of exactly this record (a 32-bit fingerprint of it), and a few bytes differ
    return torn[4:8] == want[4:8] and sum(a != b for a, b in zip(torn, want)) <= 8


def salvage_commits(path: Path, with_last: bool = False) -> list[str]:
    """Rewrite the commit log ``path`` (missing, emptied or damaged) with its intact records and
    the commit records the shards' logs beside it prove (:func:`prove`), in number order; the
    original, when there is one, is kept as ``<path>.damaged`` (``.damaged.1``, ...). The highest
    prepared number is restored when its damaged record is still the tail (:func:`tail_is`) or
    ``with_last``. :returns: lines saying what was kept, restored and left out.
    :raises OSError: reading or writing failed."""
    data = path.read_bytes() if path.exists() else b""
    records, spans = parse_spans(data)
    proof = prove(records, shard_logs(path.parent))
    said = [f"{path}: kept {len(records)} intact records" + (f"; dropped {len(spans)} damaged spans "
            f"({', '.join(f'{a}-{b}' for a, b in spans)})" if spans else "")]
    restore = dict(proof.restore)
    if proof.last is not None:
        seq, txn = proof.last
        tail = data[spans[-1][0]:] if spans and spans[-1][1] == len(data) else b""
        if with_last or tail_is(tail, seq, txn):
            restore[seq] = txn
            why = "--with-last" if with_last else "its damaged record is the log's tail"
            said.append(f"restored the commit record of the last prepared transaction {txn} (sequence {seq}): {why}")
        else:
            said.append(f"left out the last prepared transaction {txn} (sequence {seq}): every shard prepared it, but "
                        "no record says whether it was committed before the crash (pass --with-last to restore it as "
                        "committed; its client had no acknowledgement or had one)")
    if proof.restore:
        said.append(f"restored {len(proof.restore)} commit records the shards' logs prove (sequence numbers "
                    f"{sorted(proof.restore)[:10]}{' ...' if len(proof.restore) > 10 else ''})")
    if proof.unclear:
        said.append(f"numbers {proof.unclear[:10]}: the shards' logs disagree on the transaction; not restored")
    if not spans and not restore and path.exists():
        return [f"{path}: intact ({len(records)} records), nothing to restore; not changed"]
    if path.exists():
        said.append(f"the original is {keep_original(path, data)}")
    out = records + [{"txn": t, "seq": n} for n, t in restore.items()]
    out.sort(key=lambda r: (r.get("kind") != "base", int(r["seq"])))  # (the base record first, then by number)
    fsync_write(path, b"".join(encode_record(r) for r in out))
    return said
