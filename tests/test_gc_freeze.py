"""The server processes freeze their start-up objects, so that the garbage collector's full passes do not stall
the token stream (chapter 10)."""

from __future__ import annotations


def test_freezing_start_up_objects_makes_a_full_collection_cheap():
    """What the server processes do at the end of start-up: afterwards a full collection no longer walks the
    objects that existed then (counted, not timed: the count is what the pause is proportional to)."""
    import gc

    from minisgl_ref.server.process_utils import freeze_startup_objects

    before = len(gc.get_objects())
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= before // 2
        assert len(gc.get_objects()) < before // 10  # what a full pass still walks
    finally:
        gc.unfreeze()
