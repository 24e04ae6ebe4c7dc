import gc

import pytest

from orchestrator.gc_tuning import THRESHOLDS, paused_gc, tuned_gc


def test_tuned_gc_applies_inside_and_restores_after_even_on_error():
    before = gc.get_threshold()
    try:
        with tuned_gc():
            assert gc.get_threshold() == THRESHOLDS
            assert gc.get_freeze_count() > 0
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_paused_gc_disables_collection_inside_and_restores_the_previous_setting():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with paused_gc():
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
