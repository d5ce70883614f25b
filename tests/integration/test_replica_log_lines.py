"""trial47b #1: with ``--replicas 2`` every shard process's log lines read ``shard <i>: ...``, so a reader could not
tell which replica a line (a merge, a renumbering, a seeds build) came from. They now name it, ``shard <i> replica
<r>: ...``, as the frontend's ``process pid`` lines do; one replica keeps ``shard <i>: ...``."""

from __future__ import annotations

import re

import pytest

from oprag_client.testing import ServerProcess, free_port
from oprag_server.shards.state import ShardState

pytestmark = pytest.mark.integration


def test_a_replicated_shard_names_its_replica_in_its_own_log_lines(tmp_path):
    srv = ServerProcess(tmp_path, free_port(), free_port(), "--generator", "none", "--shards", "1",
                        "--replicas", "2").start()
    try:
        lines = list(srv.lines)
    finally:
        srv.stop()
    own = [ln for ln in lines if re.search(r" INFO shard 0\b", ln)]  # the shard processes' own lines (ShardState.say)
    assert any(" INFO shard 0 replica 0: " in ln for ln in own), own
    assert any(" INFO shard 0 replica 1: " in ln for ln in own), own
    assert not [ln for ln in own if " INFO shard 0: " in ln], own  # (before: every line read "shard 0: ")


def test_one_replica_keeps_the_plain_name(capsys):
    ShardState(3, 4, None).say("a line")
    ShardState(3, 4, None, who="shard 3 replica 1").say("another")
    err = capsys.readouterr().err
    assert " INFO shard 3: a line\n" in err and " INFO shard 3 replica 1: another\n" in err
