"""``rhymerl``: ours. Seer's divided rollout driven by history, placed by the cost model.

1. Prediction: a prompt with history is predicted from its earlier epochs plus its
   siblings (the furthest any of them ran is a floor); a prompt without history sends a
   probe (Seer). Predictions are conditioned on the tokens generated so far, so a
   request that outgrows its prompt's history jumps to ``max_tokens`` and to the head
   of the queue. Every group with history also sends its first sample ahead of the
   step's other requests (a scout, longest predicted first): the 2-4% of prompts whose
   length changed since the last epoch show it early, and the floor pulls their queued
   siblings forward before they could start late.
2. Order: older steps first, then longest predicted first -- unless the history says
   the step hides runaways: samples that run to ``max_tokens`` although predicted
   under ``runaway_share`` of it (expected count >= ``runaway_guard``). A runaway looks
   like its siblings until it outgrows its prompt's history, and longest-first starts
   the short groups (and their runaways) last. A prompt without history counts at the
   rate of its step's other prompts, else at the rate this run has seen in finished
   samples (the very first step knows none and runs as Seer does). Such a step runs in
   sharing mode: only requests predicted past ``long_share`` of ``max_tokens`` (known
   long, or outgrown) go longest first; the rest share the fleet fewest-generated-tokens
   first, so every request starts early and a runaway is exposed within a few chunks. With
   ``cross_step=True`` (bounded staleness 1: the caller lets the next step in while
   this one's tail runs) steps alternate long-to-short and short-to-long (HistoPipe's
   complementary order).
3. Chunks of at most ``chunk_size`` tokens; every chunk returns to the global pool, so
   an idle worker takes queued work first (work stealing needs no extra mechanism).
4. Placement: a request resumes on its previous worker (prefix cache, no re-prefill)
   unless moving it to the least-loaded worker saves more decode time than its
   re-prefill costs, both from the cost model; when that worker is full it waits for
   it (``wait_for_home``) while other queued requests can fill the free slots, and
   moves only to keep a slot from idling. A new request goes to the least loaded.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Assignment, Request, StepQuota, WorkerState
from services.scheduler.policies.placement import LeastLoaded
from services.scheduler.policies.seer import SeerPolicy


class RhymeRLPolicy(SeerPolicy):
    name = "rhymerl"
    use_history = True

    def __init__(self, chunk_size: int = 1024, cross_step: bool = False, runaway_guard: float = 1.0,
                 long_share: float = 0.5, runaway_share: float = 0.125,
                 wait_for_home: bool = True, cost: CostCurve | None = None, model_shape: str = "7B",
                 share_order: str = "las") -> None:
        if share_order not in ("las", "spt"):
            raise ValueError(f"share_order must be 'las' or 'spt', got {share_order!r}")
        super().__init__(chunk_size=chunk_size, affinity_slack=1 << 30)
        self.cross_step = cross_step
        self.runaway_guard = runaway_guard
        self.long_share = long_share
        self.runaway_share = runaway_share
        self.wait_for_home = wait_for_home
        self.share_order = share_order
        self.cost = cost or CostCurve.h100(model_shape)
        self._sharing: dict[str, bool] = {}  # live step -> whether it runs in sharing mode
        self._step_seq: dict[str, int] = {}  # live step -> arrival order of steps
        self._num_steps = 0

    def add_step_in_slices(self, requests: list[Request], lengths: LengthModel, now: float,
                           slice_size: int) -> Iterator[int]:
        """Predictions a slice at a time (nothing queued yet), then each step's sharing
        decision over the whole step, then Seer's queueing a slice at a time."""
        for request in requests:
            if request.step_id not in self._step_seq:
                self._step_seq[request.step_id] = self._num_steps
                self._num_steps += 1
        tallies: dict[str, list[float]] = {}  # step -> [sum of known rates, known, unknown]
        for start in range(0, len(requests), slice_size):
            for request in requests[start:start + slice_size]:
                request.predicted_len = lengths.predict(request)
                self._tally_runaway(request, lengths, tallies.setdefault(request.step_id, [0.0, 0, 0]))
            yield 0
        for step_id, (known_sum, num_known, num_unknown) in tallies.items():  # arrival order
            default = known_sum / num_known if num_known else lengths.finished_cap_hit_rate() or 0.0
            self._sharing[step_id] = known_sum + num_unknown * default >= self.runaway_guard
        yield from super().add_step_in_slices(requests, lengths, now, slice_size)

    def cancel_step(self, step_id: str) -> list[Request]:
        removed = super().cancel_step(step_id)
        self._step_seq.pop(step_id, None)
        self._sharing.pop(step_id, None)
        return removed

    def schedule(self, workers: list[WorkerState], now: float,
                 quota: StepQuota | None = None) -> list[Assignment]:
        if not self.num_queued():
            return []
        free = LeastLoaded(workers, affinity_slack=1 << 30)
        busy_homes = {w.worker_id for w in workers if w.healthy and w.running}
        num_slots = free.num_free()
        chosen, waiting = [], []  # 1. what runs: the queue's head, as many as there are slots
        while len(chosen) < num_slots and len(waiting) < 4 * num_slots:  # bounded scan
            request = self._pop(quota)
            if request is None:
                break
            if (self.wait_for_home and request.last_worker in busy_homes
                    and free.load_of(request.last_worker) is None):
                waiting.append(request)  # its worker is full: let it keep its prefix cache
            else:
                chosen.append(request)
        spare = num_slots - len(chosen)  # never leave a slot idle to save a move
        chosen += waiting[:spare]
        for request in waiting[spare:]:
            self._enqueue(request)
            if quota is not None:
                quota.give_back(request.step_id)
        assignments, movers = [], []
        for request in chosen:  # 2. where: returning requests keep their worker first
            worker = None
            if request.last_worker is not None and not self._pays_to_move(request, free):
                worker = free.take_worker(request.last_worker)
            if worker is None:
                movers.append(request)
            else:
                assignments.append(self._assign(request, worker, self._budget(request)))
        for request in movers:  # 3. the rest fill the least-loaded workers
            assignments.append(self._assign(request, free.take(), self._budget(request)))
        return assignments

    def on_chunk_done(self, request: Request, worker_id: str, num_new_tokens: int,
                      finished: bool, now: float) -> None:
        super().on_chunk_done(request, worker_id, num_new_tokens, finished, now)
        if finished and not self._steps.is_live(request):
            self._step_seq.pop(request.step_id, None)
            self._sharing.pop(request.step_id, None)

    # --- hooks ----------------------------------------------------------------------
    def _in_probe_tier(self, request: Request) -> bool:
        """Seer's probe tier is for groups with nothing to go on; a group with history
        scouts within its own step (``_priority``), so steps keep their order."""
        return super()._in_probe_tier(request) and not self._lengths.has_history(request.prompt_id)

    def _priority(self, request: Request) -> tuple:
        seq, arrival = self._step_seq[request.step_id], self._steps.arrival(request)
        predicted = request.predicted_len
        if request.is_probe and not self._lengths.num_finished_siblings(request.group_id):
            return (seq, 0, -predicted, -request.num_generated, arrival)  # a scout: its step's first
        if self._sharing[request.step_id] and (predicted < self.long_share * request.max_tokens
                                               or not self._informed(request)):
            if self.share_order == "spt":  # started ones keep running; new ones shortest first
                started = request.num_generated > 0
                return (seq, 2, not started, -request.num_generated if started else predicted, arrival)
            return (seq, 2, request.num_generated, -predicted, arrival)
        longest_first = not (self.cross_step and seq % 2)
        return (seq, 1, -predicted if longest_first else predicted, -request.num_generated, arrival)

    def _informed(self, request: Request) -> bool:
        """Whether its prediction rests on data (history or a finished sibling)."""
        return (self._lengths.has_history(request.prompt_id)
                or self._lengths.num_finished_siblings(request.group_id) > 0)

    def _tally_runaway(self, request: Request, lengths: LengthModel, tally: list[float]) -> None:
        """Counts toward the step's expected runaways (samples expected to hit
        ``max_tokens`` although predicted short): a short request adds the cap-hit rate of
        its prompt's history; one whose prompt has none counts at the step's mean rate, or
        else at the rate among the samples this run has finished so far."""
        if request.predicted_len >= self.runaway_share * request.max_tokens and lengths.has_history(
                request.prompt_id):
            return  # known long (without history "long" is a guess)
        rate = lengths.cap_hit_rate(request.prompt_id, request.max_tokens)
        if rate is None:
            tally[2] += 1
        else:
            tally[0] += rate
            tally[1] += 1

    def _pays_to_move(self, request: Request, free: LeastLoaded) -> bool:
        """Moving saves (remaining tokens) x (step time here - step time there); it costs
        a prefill of prompt + generated tokens on the destination."""
        min_load = free.min_load()
        here = free.load_of(request.last_worker)
        if here is None or min_load is None:
            return True  # the previous worker has no free slot (or is gone)
        remaining = max(0.0, request.predicted_len - request.num_generated)
        saving = remaining * (self.cost.forward_s(here + 1) - self.cost.forward_s(min_load + 1))
        return saving > self.cost.forward_s(request.prompt_len + request.num_generated)
