"""The scheduler's garbage-collector setting: parsed and checked at start-up (a bad value
names the field), applied once the scheduler runs, and empty leaving CPython alone."""

from __future__ import annotations

import gc

import pytest
from pydantic import ValidationError

from services.common.gc_tuning import tune_gc
from services.scheduler.settings import SchedulerSettings


def test_thresholds_are_three_integers_or_empty():
    assert SchedulerSettings(gc_thresholds="700,10,100").gc_threshold_values() == (700, 10, 100)
    assert SchedulerSettings(gc_thresholds="").gc_threshold_values() is None
    for bad in ("700,10", "a,b,c", "700,10,-1", "1,2,3,4"):
        with pytest.raises(ValidationError, match="gc_thresholds"):
            SchedulerSettings(gc_thresholds=bad)


def test_tune_gc_freezes_start_up_objects_and_sets_thresholds():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    kept = [object() for _ in range(10)]  # noqa: F841 - alive through the freeze
    try:
        tune_gc(None)
        assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
        tune_gc((1234, 11, 99))
        assert gc.get_threshold() == (1234, 11, 99)
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
