import gc

from orchestrator.gc_tuning import THRESHOLDS, tuned_gc


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
