"""A trainer that stops a rollout (Ctrl-C in the sync client, a cancelled task in the
asyncio one) stops its step in the service too (``cancel_on_interrupt``, on by default):
the step's unfinished samples end as aborts and give their slots back, instead of running
on for nobody. With the option off the step runs on, to be rejoined by its id.

Real services over loopback gRPC; every step is long (hundreds of tokens per sample on a
CPU worker), and the interrupt comes once the step has chunks on the workers (polled, not
slept for), so it always lands mid-step.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
from rhymerl import AsyncRolloutClient, RolloutClient, SamplingParams

from tests.e2e.cluster import prompts

pytestmark = pytest.mark.timeout(300)
LONG = SamplingParams(temperature=1.0, max_tokens=400, seed=5, ignore_eos=True)


def step_run(cluster, step_id: str):
    return cluster.scheduler.core.steps.get(step_id)


def wait_finished(cluster, step_id: str, timeout_s: float = 60.0):
    """The step's run once it has ended (a hang guard: the cancel ends it within moments)."""
    deadline = time.monotonic() + timeout_s
    while not (run := step_run(cluster, step_id)).is_finished:
        assert time.monotonic() < deadline, f"step {step_id} still running {timeout_s} s after the interrupt"
        time.sleep(0.02)
    return run


def assert_cancelled(cluster, client: RolloutClient, step_id: str, num_samples: int) -> None:
    """Ended by a cancel: samples aborted (a step that ran to its end has none), and the
    service reports no step running and no work on any worker."""
    run = wait_finished(cluster, step_id)
    assert run.aborted, f"step {step_id} ran to its end: it was not cancelled"
    assert 0 < len(run.aborted) <= num_samples
    deadline = time.monotonic() + 30
    while (stats := client.stats()).num_steps_running or any(w.num_running for w in stats.workers):
        assert time.monotonic() < deadline, f"the service still runs work after the cancel: {stats}"
        time.sleep(0.02)


def test_ctrl_c_in_the_sync_client_cancels_the_step_then_raises(cluster):
    """KeyboardInterrupt (what Ctrl-C raises in the main thread) during ``rollout``: the
    call re-raises it, and the step has been cancelled in the service."""
    assert threading.current_thread() is threading.main_thread()
    step_id, main = "interrupted-sync", threading.main_thread().ident
    armed = True

    def ctrl_c(signum, frame):  # Ctrl-C's KeyboardInterrupt, from a signal the test owns
        if armed:
            raise KeyboardInterrupt

    def interrupter():
        cluster.wait_running(step_id)
        signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, ctrl_c)
    thread = threading.Thread(target=interrupter, daemon=True)
    thread.start()
    try:
        with RolloutClient(cluster.address, timeout_s=120) as client:
            with pytest.raises(KeyboardInterrupt):
                try:
                    client.rollout(step_id, prompts(4, offset=800), n=8, sampling=LONG)
                finally:
                    armed = False  # past the call, a late signal raises nothing
            assert_cancelled(cluster, client, step_id, 32)
    finally:
        thread.join(130)
        signal.signal(signal.SIGUSR1, previous)


def test_a_cancelled_asyncio_rollout_cancels_its_step(cluster):
    step_id = "interrupted-async"

    async def main():
        async with AsyncRolloutClient(cluster.address, timeout_s=120) as client:
            task = asyncio.create_task(client.rollout(step_id, prompts(4, offset=840), n=8, sampling=LONG))
            await asyncio.to_thread(cluster.wait_running, step_id)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    with RolloutClient(cluster.address, timeout_s=60) as client:
        assert_cancelled(cluster, client, step_id, 32)


def test_a_timed_out_asyncio_stream_cancels_its_step(cluster):
    """``asyncio.wait_for`` around a ``submit_step`` stream: its timeout cancels the task
    reading the stream, which cancels the step."""
    step_id = "interrupted-stream"

    async def main():
        async with AsyncRolloutClient(cluster.address, timeout_s=120) as client:
            async def read():
                return [s async for s in client.submit_step(step_id, prompts(4, offset=880), n=8, sampling=LONG)]

            reader = asyncio.create_task(read())
            await asyncio.to_thread(cluster.wait_running, step_id)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader, timeout=0.01)

    asyncio.run(main())
    with RolloutClient(cluster.address, timeout_s=60) as client:
        assert_cancelled(cluster, client, step_id, 32)


def test_with_cancel_on_interrupt_off_the_step_runs_on_to_be_rejoined(cluster):
    step_id = "interrupted-kept"

    async def main():
        async with AsyncRolloutClient(cluster.address, timeout_s=120, cancel_on_interrupt=False) as client:
            task = asyncio.create_task(client.rollout(step_id, prompts(4, offset=920), n=8, sampling=LONG))
            await asyncio.to_thread(cluster.wait_running, step_id)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    run = step_run(cluster, step_id)
    assert not run.is_finished and not run.aborted  # still generating, nothing cancelled
    with RolloutClient(cluster.address, timeout_s=60) as client:
        assert client.cancel_step(step_id) > 0  # what the trainer does when it gives the step up
        assert_cancelled(cluster, client, step_id, 32)


# More samples than the two workers' 64 slots: when the first finishes, the rest still run.
WAVES = SamplingParams(temperature=1.0, max_tokens=48, seed=5, ignore_eos=True)


def test_ctrl_c_in_the_loop_body_of_a_with_block_cancels_the_step(cluster):
    """A KeyboardInterrupt in the trainer's own loop body never reaches the stream's
    generator; ``with client.submit_step(...) as stream`` hands it to the stream, which
    cancels the step before it goes on."""
    step_id = "interrupted-body"
    with RolloutClient(cluster.address, timeout_s=120) as client:
        with pytest.raises(KeyboardInterrupt):
            with client.submit_step(step_id, prompts(16, offset=960), n=8, sampling=WAVES) as stream:
                for _ in stream:
                    raise KeyboardInterrupt  # Ctrl-C while the trainer handles its first sample
        assert_cancelled(cluster, client, step_id, 128)


def test_a_task_cancelled_in_the_loop_body_of_an_async_with_block_cancels_the_step(cluster):
    step_id = "interrupted-async-body"

    async def main():
        async with AsyncRolloutClient(cluster.address, timeout_s=120) as client:
            got_one = asyncio.Event()

            async def read():
                async with client.submit_step(step_id, prompts(16, offset=1000), n=8, sampling=WAVES) as stream:
                    async for _ in stream:
                        got_one.set()
                        await asyncio.sleep(3600)  # the trainer's own await, where the cancellation lands

            reader = asyncio.create_task(read())
            await asyncio.wait_for(got_one.wait(), 120)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader

    asyncio.run(main())
    with RolloutClient(cluster.address, timeout_s=60) as client:
        assert_cancelled(cluster, client, step_id, 128)
