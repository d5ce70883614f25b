"""A step of a shard's request loop that holds it longer than ``SLOW_S`` is logged with what it was (session 41:
2.7-4.5 s searches during an ingest left no line in the log to attribute them by); a quick one is not."""

from __future__ import annotations

import time

import numpy as np

from oprag_server.shards import worker
from oprag_server.shards.state import ShardState


def test_a_slow_loop_step_is_logged_with_what_it_was(monkeypatch, capsys):
    sh = ShardState(3, 4, None)
    monkeypatch.setattr(worker, "SLOW_S", 0.05)
    assert worker._timed(sh, "a SEARCH request", lambda x: x + 1, 1) == 2  # quick: nothing said
    assert "held the request loop" not in capsys.readouterr().err
    worker._timed(sh, "a SEARCH request", time.sleep, 0.08)
    err = capsys.readouterr().err
    assert "INFO shard 3: a SEARCH request held the request loop 0.0" in err and err.count("\n") == 1, err
    try:
        worker._timed(sh, "a background step", lambda: (time.sleep(0.06), np.zeros(1)[5])[1])
    except IndexError:
        pass
    assert "a background step held the request loop" in capsys.readouterr().err  # (logged when it fails too)
