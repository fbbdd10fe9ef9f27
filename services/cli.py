"""The `rhymerl` command: one sub-command per process, plus `local-run`."""

from __future__ import annotations

import asyncio
import logging

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="rhymerl rollout service")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def history(log_level: str = "info") -> None:
    """Run the history service (settings: RHYMERL_HISTORY_*)."""
    from services.history.server import serve
    from services.history.settings import HistorySettings

    _logging(log_level)
    asyncio.run(serve(HistorySettings()))


@app.command()
def scheduler(log_level: str = "info") -> None:
    """Run the scheduler (settings: RHYMERL_SCHEDULER_*)."""
    from services.scheduler.server import serve
    from services.scheduler.settings import SchedulerSettings

    _logging(log_level)
    asyncio.run(serve(SchedulerSettings()))


@app.command()
def worker(log_level: str = "info") -> None:
    """Run a rollout worker (settings: RHYMERL_WORKER_*)."""
    from services.rollout.server import serve
    from services.rollout.settings import WorkerSettings

    _logging(log_level)
    asyncio.run(serve(WorkerSettings()))


@app.command("local-run")
def local_run(workers: int = typer.Option(2, help="CPU rollout workers"),
              steps: int = typer.Option(6, help="GRPO steps"),
              prompts: int = typer.Option(8, help="prompts per step (the same set every step: RL epochs)"),
              n: int = typer.Option(4, help="samples per prompt"),
              max_tokens: int = typer.Option(160, help="max tokens per sample"),
              policy: str = typer.Option("rhymerl", help="placement policy"),
              model_dir: str = typer.Option("models/tiny", help="trained here if missing"),
              record: str = typer.Option("", help="write every rollout as a trace file"),
              temperature: float = typer.Option(1.0, help="sampling temperature"),
              seed: int = typer.Option(0, help="picks the prompt set and the sampling seeds"),
              partial_credit: float = typer.Option(
                  0.5, help="reward share for reproducing the worked steps (0: binary reward; a tiny "
                            "policy rarely gets a whole answer right, so groups would teach nothing)"),
              log_level: str = "warning") -> None:
    """Start Redis, history, scheduler and CPU workers, then run a short GRPO loop."""
    from services.local import run_local

    _logging(log_level)
    run_local(num_workers=workers, steps=steps, num_prompts=prompts, n=n, max_tokens=max_tokens,
              policy=policy, model_dir=model_dir, record=record, partial_credit=partial_credit,
              temperature=temperature, seed=seed)


if __name__ == "__main__":
    app()
