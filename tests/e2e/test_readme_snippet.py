"""The README's SDK snippet runs as written against a local system (only the
scheduler's address differs: the test's cluster listens on a free port), and a step's
samples come back in prompt order, then sample_index order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rhymerl import RolloutClient, SamplingParams

from tests.e2e.cluster import prompts

pytestmark = pytest.mark.timeout(300)
README = Path(__file__).resolve().parents[2] / "README.md"


def snippet() -> str:
    [code] = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
              if "RolloutClient(" in block]
    return code


def test_the_readme_sdk_snippet_runs_as_written(cluster, capsys):
    code = snippet()
    assert '"localhost:50051"' in code
    exec(compile(code.replace('"localhost:50051"', repr(cluster.address)), "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[1]) for line in lines[:8]] == list(range(8))  # sample_index order
    assert lines[8].split() == ["0.0", "0.0"]  # the rollout's own logprobs: no mismatch


def test_rollout_returns_samples_in_prompt_then_sample_order(cluster):
    ps = prompts(5, offset=90)
    with RolloutClient(cluster.address, timeout_s=120) as client:
        result = client.rollout("ordered", ps, n=4, sampling=SamplingParams(temperature=1.0, max_tokens=24,
                                                                             seed=2))
    assert [(s.prompt_id, s.sample_index) for s in result.samples] == [(p.prompt_id, k) for p in ps for k in range(4)]
