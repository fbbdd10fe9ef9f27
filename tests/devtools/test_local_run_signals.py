"""`python -m devtools.local_run` stopped by SIGTERM (a time limit, `kill`) mid-run stops
every process it started: none is left behind holding ports, redis or a model in memory."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tiny_llm import train_sft
from services.rollout.loader import init_random_model

ROOT = Path(__file__).resolve().parents[2]
MICRO = dataclasses.replace(train_sft.PRESETS["tiny"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.update(children)
            todo += children
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_mid_run_stops_every_service_it_started(tmp_path):
    model = tmp_path / "micro"
    train_sft.save_checkpoint(init_random_model(train_sft.model_config(MICRO), seed=0), model)
    run = subprocess.Popen(
        [sys.executable, "-m", "devtools.local_run", "--model-dir", str(model), "--steps", "1000", "--prompts", "2",
         "--n", "2", "--max-tokens", "8", "--workers", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RHYMERL_LOCAL_LOG_DIR": str(tmp_path / "logs")})
    started: set[int] = set()
    try:
        for line in run.stdout:  # the services are up and the trainer's steps have begun
            if line.startswith("step 0:"):
                break
        else:
            pytest.fail(f"local_run ended before its first step (exit {run.wait()})")
        started = descendants(run.pid)
        assert len(started) >= 4  # redis-server, history, scheduler, a worker
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM
        left = {pid for pid in started if alive(pid)}
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]
    finally:
        for pid in started | descendants(run.pid) | {run.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        run.wait()
