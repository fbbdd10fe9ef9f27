"""What `make run` runs: the whole system on this machine, a short GRPO loop through the
SDK's example trainer, and a summary of what happened.

    python -m devtools.local_run [--steps 6] [--workers 2] ...   # --help lists every option
    python -m devtools.local_run --model smollm2 --steps 2 --prompts 4 --n 4 --max-tokens 32
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.settings_cli import settings_command
from services.scheduler.policies import POLICIES


class LocalRunSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_LOCAL_", protected_namespaces=())

    workers: int = Field(2, ge=1, description="CPU rollout workers, each its own process.")
    steps: int = Field(6, ge=1, description="GRPO steps.")
    prompts: int = Field(8, ge=1, description="Prompts per step (the same set every step: RL epochs).")
    n: int = Field(4, ge=1, description="Samples per prompt (the GRPO group).")
    max_tokens: int = Field(160, ge=1, description="Most tokens per sample.")
    policy: Literal[tuple(POLICIES)] = Field("rhymerl", description="Placement policy of the scheduler.")
    model: Literal["tiny", "smollm2"] = Field(
        "tiny", description="The policy: 'tiny' (trained here, fast) on the synthetic task, or 'smollm2' "
                            "(SmolLM2-135M-Instruct, fetched by `make model-smollm2`) on English word problems, "
                            "training its last 2 layers (slow on a CPU).")
    model_dir: str = Field("models/tiny", description="The policy checkpoint; trained here if missing (4-6 min on 2 cores). "
                                                      "With --model smollm2 the default is models/smollm2-135m.")
    log_dir: str = Field("runs/local", description="The services' logs, redis data and the scheduler's weight "
                                                  "files (two runs at once need two directories).")
    record: str = Field("", description="Write every rollout to this trace file (.npz); empty: not recorded.")
    resume: bool = Field(False, description="Continue the --record run from its last finished step (its state is kept "
                                            "beside the trace file), against the services started now.")
    step_timeout_s: float = Field(600.0, gt=0, description="The trainer's deadline per rollout call (the SDK's "
                                                           "timeout_s: a whole step's stream; an unanswered call is "
                                                           "re-sent for up to 2 minutes): raise it for long steps on "
                                                           "a CPU.")
    worker_threads: int = Field(1, ge=1, description="Torch threads of each worker process (OMP_NUM_THREADS).")
    max_num_seqs: int = Field(64, ge=1, description="Sequences each worker decodes at once.")
    kv_blocks: int = Field(1024, ge=1, description="KV-cache blocks of 16 tokens per worker (a real model's long "
                                                   "samples need max_num_seqs x their length / 16 to avoid "
                                                   "preemptions).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    seed: int = Field(0, description="Picks the prompt set and the sampling seeds.")
    partial_credit: float = Field(
        0.5, ge=0, le=1, description="Reward share for reproducing the worked steps (0: binary reward; a tiny policy "
                                     "rarely gets a whole answer right, so its groups would teach nothing).")
    measure_cost: bool = Field(
        False, description="Workers measure this machine's forward cost and draft only where it pays (on a CPU: "
                           "rarely); off: they use the H100 table of docs/cost-model.md, the same on every machine.")


def policy_checkpoint(settings: LocalRunSettings) -> tuple[str, dict]:
    """(the checkpoint directory, made first if missing; the example trainer's options for it)."""
    if settings.model == "smollm2":
        from devtools.smollm2 import FetchError, ensure_smollm2

        model_dir = "models/smollm2-135m" if settings.model_dir == "models/tiny" else settings.model_dir
        try:
            ensure_smollm2(Path(model_dir))
        except FetchError as e:
            raise SystemExit(f"error: {e}") from None
        return model_dir, {"task": "words", "train_layers": 2}
    from benchmarks.tiny_llm.checkpoint import ensure_model

    ensure_model(settings.model_dir)
    return settings.model_dir, {}


def run_local(settings: LocalRunSettings) -> None:
    import os
    import signal
    import sys

    from benchmarks.tiny_llm.examples import load_example
    from devtools.run_summary import summary
    from services.local import ROOT, LocalCluster

    model_dir, trainer_options = policy_checkpoint(settings)
    print(f"starting history (with its redis-server), the scheduler and {settings.workers} CPU workers; "
          f"each loads the policy (logs in {settings.log_dir}/)...", flush=True)
    start = time.monotonic()
    cluster = LocalCluster(model_dir=model_dir, num_workers=settings.workers, policy=settings.policy,
                           log_dir=ROOT / settings.log_dir,  # relative: to the repository
                           extra_env={"RHYMERL_WORKER_MEASURE_COST": str(settings.measure_cost).lower()},
                           worker_env={f"worker-{i}": {"OMP_NUM_THREADS": settings.worker_threads,
                                                       "RHYMERL_WORKER_MAX_NUM_SEQS": settings.max_num_seqs,
                                                       "RHYMERL_WORKER_NUM_KV_BLOCKS": settings.kv_blocks}
                                       for i in range(settings.workers)})

    def on_sigterm(signum, frame) -> None:
        """SIGTERM (a time limit, `kill`): the processes this run started are stopped here
        (each drains), then the run exits at once with 128 + SIGTERM, without unwinding
        through the trainer, its client and the gRPC call in flight (twice under heavy
        load such an unwinding had not reached the cluster's stop after 120 s; a run
        stopped mid-step keeps its last finished step's state either way). Ctrl-C unwinds."""
        cluster.stop()
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    with cluster:
        print(f"rhymerl is up after {time.monotonic() - start:.0f} s: scheduler {cluster.scheduler_address}, "
              f"metrics on ports {sorted(cluster.metrics_ports.values())}", flush=True)
        from rhymerl import RolloutClient
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bar would land among the step lines
        trainer = load_example("grpo_trainer")
        print(f"loading the trainer's copy of the policy, then {settings.steps} GRPO steps of {settings.prompts} "
              f"prompts x {settings.n} samples (each step: rollout, rewards, update, weight push)", flush=True)
        with RolloutClient(cluster.scheduler_address, timeout_s=settings.step_timeout_s) as client:
            rows = trainer.run(client, model_dir, steps=settings.steps, num_prompts=settings.prompts,
                               n=settings.n, max_tokens=settings.max_tokens, record=settings.record or None,
                               resume=settings.resume, partial_credit=settings.partial_credit,
                               temperature=settings.temperature,
                               seed=settings.seed, **trainer_options)
        print("stopping the services (workers drain first)...", flush=True)
    print(summary(rows, settings.measure_cost), flush=True)


app = typer.Typer(add_completion=False, rich_markup_mode=None)
settings_command(app, "local-run", LocalRunSettings,
                 "Start Redis, history, scheduler and CPU workers, then run a short GRPO loop and summarise it.",
                 log_level="warning")(run_local)

if __name__ == "__main__":
    app()
