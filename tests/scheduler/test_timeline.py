"""StepTimeline on a hand-computed example: these are the numbers the dashboards and
the benchmark report, so a wrong definition here misreports every step."""

import pytest

from services.scheduler.timeline import StepTimeline


def test_timeline_numbers_match_a_hand_computed_step():
    # Two workers; dispatch at t=1. w0 busy 1..9, w1 busy 1..3 and 5..6.
    # Ten samples finish at 2,2,3,3,4,5,5,6,7,9: the tail is the last one (ceil(10%)),
    # from the 9th result (t=7) to the last (t=9).
    timeline = StepTimeline("s", ["w0", "w1"])
    timeline.on_dispatch("w0", 1.0)
    timeline.on_dispatch("w1", 1.0)
    timeline.on_worker_busy("w0", True, 1.0)
    timeline.on_worker_busy("w1", True, 1.0)
    timeline.on_worker_busy("w1", True, 2.0)  # repeated "busy" changes nothing
    timeline.on_worker_busy("w1", False, 3.0)
    timeline.on_worker_busy("w1", True, 5.0)
    timeline.on_worker_busy("w1", False, 6.0)
    for t in [2, 2, 3, 3, 4, 5, 5, 6, 7, 9]:
        timeline.on_sample_done(float(t))
    timeline.on_migration()
    timeline.on_migration(2)
    stats = timeline.finish(now=12.0)  # w0 still "busy": its interval closes at the last result
    assert stats.makespan_s == 8.0
    assert stats.worker_busy_s == {"w0": 8.0, "w1": 3.0}
    assert stats.bubble_ratio == pytest.approx((16 - 11) / 16)
    assert stats.tail_time_s == 2.0
    assert stats.num_migrations == 3
    assert (stats.num_samples, stats.num_workers) == (10, 2)


def test_timeline_tail_covers_ten_percent_rounded_up_and_clips_busy_time():
    # 25 samples -> the last 3 are the tail; busy time before the first dispatch
    # (the previous step's work) does not count for this step.
    timeline = StepTimeline("s", ["w0"])
    timeline.add_busy_interval("w0", -5.0, 10.0)
    timeline.on_dispatch("w0", 0.0)
    for t in range(1, 26):
        timeline.on_sample_done(float(t))
    stats = timeline.finish(now=25.0)
    assert stats.tail_time_s == 25.0 - 22.0
    assert stats.worker_busy_s["w0"] == 10.0
    assert stats.bubble_ratio == pytest.approx(15 / 25)


def test_timeline_of_an_empty_step_is_all_zero():
    stats = StepTimeline("s", ["w0"]).finish(now=3.0)
    assert (stats.makespan_s, stats.bubble_ratio, stats.tail_time_s, stats.num_samples) == (0, 0, 0, 0)
