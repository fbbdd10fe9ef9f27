"""benchmarks.drafter_calls: its two ways of committing one request's step reach the same
drafts, so the A/B times the same work."""

from __future__ import annotations

from benchmarks import drafter_calls as C


def test_both_ways_commit_the_same_and_every_step_is_timed():
    """Breaks if the two drafters drift apart (measure asserts the commits agree step by
    step) or a way's calls go untimed."""
    times = C.measure(300)
    assert set(times) == {"propose commit_step", "commit commit_step", "propose staged", "commit staged"}
    assert all(len(ns) == 300 and min(ns) >= 0 for ns in times.values())
