"""The example GRPO trainer run twice, as its command line, against one running service.

A second run once replayed the first run's step 0 (the same step id: the idempotency key
returned the old samples, sampled by another policy) and then failed its first weight push
(FAILED_PRECONDITION: version 1 is not above the version serving, 2). Now each run names
its steps by a run id of its own, and starts its versions from the one serving: against a
service an earlier run updated, it first pushes its own starting weights as the next one.
"""

from __future__ import annotations

import pytest

from benchmarks.tiny_llm.examples import load_example
from services.common.traces import read_traces
from tests.e2e.cluster import Cluster
from tests.tiny_llm.test_grpo import save_micro_checkpoint

pytestmark = pytest.mark.timeout(300)
grpo = load_example("grpo_trainer")


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    return save_micro_checkpoint(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="module")
def service(micro_dir, redis_url):
    c = Cluster(model_dir=micro_dir, redis_url=redis_url, num_workers=1).start()
    yield c
    c.stop()


def test_the_trainer_runs_twice_against_one_service(service, micro_dir, tmp_path, capsys):
    def trainer(record: str, *more: str) -> list[dict]:
        return grpo.main(["--address", service.address, "--model-dir", micro_dir, "--steps", "2", "--prompts", "2",
                          "--n", "2", "--max-tokens", "8", "--record", str(tmp_path / record), *more])

    first = trainer("first.npz")
    first_lines = capsys.readouterr().out.splitlines()
    second = trainer("second.npz")
    second_lines = capsys.readouterr().out.splitlines()

    assert [row["version"] for row in first] == [1, 2]
    assert first_lines[0].endswith("starting at policy version 0")
    # The second run's own starting weights go first (the service served the first run's
    # last policy), then its steps' pushes continue above.
    assert "the service served policy version 2" in second_lines[0] and "as version 3" in second_lines[0]
    assert [row["version"] for row in second] == [4, 5]
    assert service.scheduler.core.policy_version == 5
    # Nothing replayed: the second run's samples were made by its own policy (3, then 4),
    # not returned from the first run's steps (made by 0, then 1).
    for name, versions in (("first.npz", {0: {0}, 1: {1}}), ("second.npz", {0: {3}, 1: {4}})):
        records = read_traces(tmp_path / name)
        assert len(records) == 8
        assert {e: {r.policy_version for r in records if r.epoch == e} for e in (0, 1)} == versions, name
    first_id, second_id = (lines[0].split()[1].rstrip(":") for lines in (first_lines, second_lines))
    assert first_id != second_id
    for step_id in (f"grpo-{first_id}-step0-v0", f"grpo-{first_id}-step1-v1", f"grpo-{second_id}-step0-v3",
                    f"grpo-{second_id}-step1-v4"):
        assert step_id in service.scheduler.core.steps


def test_a_given_run_id_names_the_steps(service, micro_dir, capsys):
    """--run-id: the step ids are the ones given (a restarted trainer passes its own again)."""
    stats = grpo.main(["--address", service.address, "--model-dir", micro_dir, "--steps", "1", "--prompts", "2",
                       "--n", "2", "--max-tokens", "8", "--run-id", "named-run"])
    serving = stats[0]["version"] - 1  # the version its first step sampled
    assert capsys.readouterr().out.splitlines()[0].startswith("run named-run: ")
    assert service.scheduler.core.steps.get(f"grpo-named-run-step0-v{serving}") is not None
