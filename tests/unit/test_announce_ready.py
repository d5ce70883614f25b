"""``startup.announce_ready``: the READY line a supervisor waits for, printed after the start-up's
objects left the garbage collector's generations (a full collection visits only newer ones)."""

from __future__ import annotations

import gc

from oprag_server.startup import announce_ready


def test_the_ready_line_follows_a_freeze_of_the_start_up_objects(capsys):
    kept = [[i] for i in range(1000)]  # objects of "the start-up"
    gc.unfreeze()
    try:
        announce_ready("127.0.0.1", 50051)
        assert gc.get_freeze_count() >= len(kept)
        assert capsys.readouterr().out == "OPRAG READY 127.0.0.1:50051\n"
        young = sum(len(gc.get_objects(g)) for g in range(3))
        assert young < gc.get_freeze_count()  # what a collection still visits is the little created since
    finally:
        gc.unfreeze()
