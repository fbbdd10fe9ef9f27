"""CPython's cyclic garbage collector in a long-running service process.

Two things, both set once the process has started (docs/architecture.md measures each):

- ``tune_gc``: what start-up allocated (imports, the model, servers, settings) is frozen
  (``gc.freeze``: the collector never scans it again) and collections run at the given
  thresholds (the scheduler's).
- ``StepCollector``: the collections of an engine's process run where they cost nothing,
  while the device computes a step's forward (the engine calls it right after launching
  the forward, where it also exports the last step's metrics), instead of inside whichever
  call allocates the object that crosses the young generation's threshold: on the step's
  critical path, in the schedule, the drafter's calls, the layout or the commit (a
  gen-0 collection there is some tens of microseconds, a full one milliseconds). It
  decides the generation as CPython does (``gc.get_count`` against the thresholds), without
  CPython's one extra condition for a full collection (that the objects not yet scanned by
  one are at least a quarter of the long-lived ones: CPython does not expose that count).
  Automatic collections stay on as a safety net at ``AUTOMATIC_FACTOR`` times the young
  threshold: they run where no step runs (an idle engine, other threads' allocations) or
  where a single step allocates that much.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)

AUTOMATIC_FACTOR = 50  # automatic collections wait for this many times StepCollector's young threshold


def parse_thresholds(value: str, field: str) -> tuple[int, int, int] | None:
    """"gen0,gen1,gen2" (three non-negative integers, as gc.set_threshold takes them) or
    empty (None: CPython's defaults). ValueError naming `field` otherwise."""
    if not value.strip():
        return None
    parts = value.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{field}: three non-negative integers gen0,gen1,gen2 or empty, not {value!r}")
    gen0, gen1, gen2 = (int(p) for p in parts)
    return gen0, gen1, gen2


def tune_gc(thresholds: tuple[int, int, int] | None) -> None:
    """Freezes what start-up allocated (the collector never scans it again) and sets the
    collector's thresholds; None leaves CPython's defaults."""
    if thresholds is None:
        return
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit, collected as usual (extension modules count what is never freed)
    gc.set_threshold(*thresholds)
    log.info("garbage collector: %d start-up objects frozen, thresholds %s", gc.get_freeze_count(), thresholds)


class StepCollector:
    """Collects when the caller says it costs nothing (see the module docstring).

    Args:
        thresholds: (young, middle, old): collect once more than ``young`` objects were
            allocated (net of those freed) since the last collection; after ``middle`` of
            those the next collects the middle generation too, after ``old`` of those the
            next everything (as gc.set_threshold's three values, compared as CPython
            does: a collection once a count is above its threshold).
    """

    def __init__(self, thresholds: tuple[int, int, int] = (700, 10, 100)) -> None:
        young, middle, old = thresholds
        if young < 1 or middle < 1 or old < 1:
            raise ValueError(f"collector thresholds must be positive, not {thresholds}")
        self.young, self.middle, self.old = young, middle, old
        self.collections = [0, 0, 0]  # by generation, run here
        self.running = False  # inside __call__ (watch_pauses tells its collections from the others)

    def install(self) -> None:
        """Freezes start-up objects and pushes automatic collections back (tune_gc), so
        that this collector runs them; call once the process has started."""
        tune_gc((self.young * AUTOMATIC_FACTOR, self.middle, self.old))

    def __call__(self) -> int:
        """Collects if the young generation is full; returns the generation collected, or
        -1 if none was due (two integer reads then)."""
        young, middle, old = gc.get_count()
        if young <= self.young:
            return -1
        generation = 2 if old > self.old else 1 if middle > self.middle else 0
        self.running = True
        try:
            gc.collect(generation)
        finally:
            self.running = False
        self.collections[generation] += 1
        return generation

    def watch_pauses(self, observe) -> None:
        """Calls ``observe(seconds, where)`` after every collection of this process: where
        "forward" for this collector's own, "elsewhere" for an automatic one (inside a
        step's host work, or while the engine idles)."""
        started = [0.0]

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                observe(time.perf_counter() - started[0], "forward" if self.running else "elsewhere")

        gc.callbacks.append(callback)
