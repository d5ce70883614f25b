"""The owner lease of a ``--storage-uri``: one server at a time writes there.

Two servers on one storage would both acknowledge writes and put log objects at the same
positions, each losing the other's documents. The lease is the object ``owner`` at the
storage's root: ``{"id", "host", "pid", "heartbeat"}`` (``heartbeat``: Unix time, seconds),
put again by its holder every ``renew_s`` seconds. A start that finds a lease of another
server whose heartbeat is younger than ``ttl_s`` is refused (the message names the holder);
``--storage-takeover`` takes it anyway. A lease held by a process of this host that no longer
exists (a server SIGKILLed and started again on the same machine) counts as expired at once. A holder that finds on renewal that another server
holds the lease is *fenced*: it stops acknowledging writes (UNAVAILABLE) and turns health
NOT_SERVING instead of writing over the new owner's objects. A lease found missing on renewal
(the storage was wiped) is put back.

Object stores have no compare-and-swap in ``pyarrow.fs``: two starts within the same instant
can both read "free"; each re-reads its own lease after putting it, and log objects are written
only where none exists (:meth:`.objstore.ObjectStore.put_new`), so the loser of such a race
fails its writes instead of overwriting.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .objstore import ObjectStore

KEY = "owner"


class LeaseHeld(RuntimeError):
    """Another live server holds the lease."""


class OwnerLease:
    """This server's lease on ``store`` (not yet acquired).

    :param ttl_s: a heartbeat older than this (seconds) is expired: its holder is taken as gone.
    :param renew_s: how often the holder renews (seconds; well under ``ttl_s``).
    """

    def __init__(self, store: ObjectStore, ttl_s: float = 30.0, renew_s: float = 5.0) -> None:
        self.store, self.ttl_s, self.renew_s = store, ttl_s, renew_s
        self.me = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        self.fenced: str | None = None  # why this server may no longer write (None: it may)

    def read(self) -> dict | None:
        """The lease in the store (None: none)."""
        raw = self.store.get(KEY)
        try:
            return json.loads(raw) if raw is not None else None
        except ValueError:
            return None  # a torn lease counts as none

    def _put(self) -> None:
        self.store.put_atomic(KEY, json.dumps({**self.me, "heartbeat": time.time()}).encode())

    def describe(self, other: dict) -> str:
        age = time.time() - float(other.get("heartbeat", 0))
        return (f"server {other.get('id')} on host {other.get('host')} (pid {other.get('pid')}), "
                f"last heartbeat {age:.0f} s ago")

    def _dead_here(self, other: dict) -> bool:
        """Whether ``other`` names a process of this host that is gone (its lease is stale)."""
        if other.get("host") != self.me["host"] or not isinstance(other.get("pid"), int):
            return False
        if other["pid"] == self.me["pid"]:
            return False
        try:
            os.kill(other["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # exists, owned by another user
        try:  # a zombie (killed, not reaped yet) is gone too: a restart 0.5 s after kill -9 was refused (trial59b F9)
            stat = Path(f"/proc/{other['pid']}/stat").read_text()
            return stat[stat.rindex(")") + 2:][:1] in ("Z", "X")
        except (OSError, ValueError):
            return False

    def acquire(self, takeover: bool = False, check_only: bool = False) -> dict | None:
        """Take the lease (``check_only``: only check that it could be taken, put nothing).
        :returns: the previous holder's lease when one was replaced (taken over or expired),
            else None.

        :raises LeaseHeld: another server's lease is live and ``takeover`` is False."""
        other = self.read()
        live = (other is not None and time.time() - float(other.get("heartbeat", 0)) < self.ttl_s
                and not self._dead_here(other))
        if live and not takeover:
            raise LeaseHeld(
                f"--storage-uri {self.store.uri} is in use by {self.describe(other)}: stop that server (its lease "
                f"expires {self.ttl_s:.0f} s after its last heartbeat), or start with --storage-takeover to fence it "
                "(it then refuses writes)")
        if check_only:
            return None
        self._put()
        now = self.read()
        if now is None or now.get("id") != self.me["id"]:
            raise LeaseHeld(f"--storage-uri {self.store.uri}: another server took the lease at the same time "
                            f"({self.describe(now or {})}); start again")
        return other

    def renew(self) -> str:
        """Renew the heartbeat. :returns: ``"ok"``; ``"gone"`` (no lease in the store: put back;
        the storage was probably wiped); ``"taken"`` (another server holds it: this one is
        fenced from now on and renews nothing)."""
        if self.fenced:
            return "taken"
        cur = self.read()
        if cur is not None and cur.get("id") != self.me["id"]:
            self.fenced = (f"this server no longer owns --storage-uri {self.store.uri}: {self.describe(cur)} "
                           "took it over; writes are refused (stop this server)")
            return "taken"
        self._put()
        return "ok" if cur is not None else "gone"

    def release(self) -> None:
        """Delete the lease if this server still holds it (a clean stop)."""
        cur = self.read()
        if cur is not None and cur.get("id") == self.me["id"]:
            self.store.delete([KEY])


@contextmanager
def renewing(lease: "OwnerLease | None") -> Iterator[None]:
    """Renew ``lease`` (None: nothing) every ``renew_s`` seconds from a thread while the block runs: the start's
    blocking steps (a snapshot seeded, downloaded or loaded, a log replayed: minutes at 1M chunks) left the heartbeat
    as old as the start, so another server could take a live holder's lease after ``ttl_s`` (trial59 F5 saw "last
    heartbeat 8 s ago" a second after a seeding start was killed). A renewal the storage refuses is retried."""
    if lease is None:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(lease.renew_s) and not lease.fenced:
            try:
                lease.renew()
            except Exception:  # noqa: BLE001, S110 - the storage refused: the next round tries again
                pass

    t = threading.Thread(target=run, name="oprag-lease-start", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
