"""ReportRewards: each reward checked against the step and sample it names, then kept in
history beside the sample (the drafter weighs earlier responses by them).

An unknown step, or a sample the step does not have, is NOT_FOUND, and a sample still
running FAILED_PRECONDITION (as ReportLogprobs answers; a reward is of a finished
sample, and one that is then cancelled would leave its reward without a sample):
nothing is written, since history would otherwise keep a stray entry until its TTL. History down,
or not answering in time, is UNAVAILABLE naming it (the trainer's SDK retries; a reward
stored twice is counted once).
"""

from __future__ import annotations

import grpc
from rhymerl.v1 import rollout_pb2

from services.common.errors import DOWNSTREAM_UNAVAILABLE, FailedPrecondition, NotFound, Unavailable
from services.common.validation import check_id
from services.scheduler import intake
from services.scheduler.core import SchedulerCore


async def record_rewards(req: rollout_pb2.ReportRewardsRequest, core: SchedulerCore, history) -> int:
    """Returns how many rewards history newly stored. The step is found first, and a report
    longer than the step has samples is refused before any reward is looked at: checking
    each reward of a report as long as the message limit allows (millions, for a step
    that may not even exist) held the scheduler's event loop for seconds, every step's
    dispatch with it."""
    check_id(req.step_id, "step_id")
    run = core.steps.get(req.step_id)
    done = None  # the finished samples of a step still running (None: all are)
    if run is not None:
        has_sample, aborted, size = run.has_sample, run.aborted, run.num_samples
        if not run.is_finished:
            done = {(s.prompt_id, s.sample_index) for s in run.sample_results()}
    else:  # dropped from memory, or sampled before a scheduler restart
        logged = await core.log.load(req.step_id, samples=False)
        if logged is None:
            raise NotFound(f"no step {req.step_id!r}", "step_id")
        has_sample, aborted = (lambda p, k: 0 <= k < logged.n and p in logged.prompt_ids), set()
        size = logged.n * len(logged.prompt_ids)
    intake.check_report_size(len(req.rewards), size)
    intake.check_rewards(req)
    for i, r in enumerate(req.rewards):
        if not has_sample(r.prompt_id, r.sample_index):
            raise NotFound(f"no sample ({r.prompt_id!r}, {r.sample_index}) in step {req.step_id!r}", f"rewards[{i}]")
        if done is not None and (r.prompt_id, r.sample_index) not in done:
            raise FailedPrecondition(f"sample ({r.prompt_id!r}, {r.sample_index}) has not finished", f"rewards[{i}]")
    # An aborted sample is not in history: a reward for it would have nothing to sit beside.
    rows = [(r.prompt_id, req.step_id, r.sample_index, r.reward) for r in req.rewards
            if (r.prompt_id, r.sample_index) not in aborted]
    if history is None or not rows:
        return 0
    try:
        return await history.put_rewards(rows)
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in DOWNSTREAM_UNAVAILABLE:
            raise
        raise Unavailable(f"the history service (rhymerl.v1.HistoryService) did not store the rewards: "
                          f"{exc.code().name}: {exc.details()}; retry") from None
