"""A shard whose frontend is gone when it sends a reply (the frontend killed while the shard
worked, trial24) ends quietly as it does between requests (``worker._gone``), instead of logging
two tracebacks (``BrokenPipeError``, then the same while sending the error) and dying with a
traceback; a failing request is still answered with its error."""

from __future__ import annotations

import pytest

from oprag_server.shards import worker


class _Gone(Exception):
    pass


class _Conn:
    def __init__(self, exc=None):
        self.exc, self.sent = exc, []

    def send(self, obj):
        if self.exc is not None:
            raise self.exc
        self.sent.append(obj)


@pytest.fixture
def quiet(monkeypatch):
    printed = []
    monkeypatch.setattr(worker, "_gone", lambda: (_ for _ in ()).throw(_Gone()))
    monkeypatch.setattr(worker, "print_failure", printed.append)
    return printed


@pytest.mark.parametrize("exc", [BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")])
@pytest.mark.parametrize("fails", [False, True])
def test_a_reply_to_a_frontend_that_left_ends_the_shard_quietly(monkeypatch, quiet, exc, fails):
    def dispatch(table, op, req):
        if fails:
            raise ValueError("bad request")
        return {"ok": 1}

    monkeypatch.setattr(worker, "dispatch", dispatch)
    with pytest.raises(_Gone):
        worker._answer(_Conn(exc), None, 7, "op", None)
    assert [type(e) for e in quiet] == ([ValueError] if fails else [])  # the request's own error only


def test_a_failing_request_is_answered_with_its_error(monkeypatch, quiet):
    monkeypatch.setattr(worker, "dispatch", lambda *a: (_ for _ in ()).throw(ValueError("bad request")))
    conn = _Conn()
    worker._answer(conn, None, 7, "op", None)
    assert conn.sent == [(7, False, "ValueError: bad request")] and len(quiet) == 1


def test_a_reply_that_cannot_be_sent_is_answered_with_that_error(monkeypatch, quiet):
    monkeypatch.setattr(worker, "dispatch", lambda *a: {"ok": 1})

    class _Once(_Conn):
        def send(self, obj):
            if obj[1]:
                raise TypeError("cannot pickle 'generator' object")
            self.sent.append(obj)

    conn = _Once()
    worker._answer(conn, None, 7, "op", None)
    assert conn.sent == [(7, False, "TypeError: cannot pickle 'generator' object")]
