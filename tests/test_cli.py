"""`rhymerl <sub-command> --help` (and `python -m devtools.local_run --help`) lists every
setting the process reads, and the options and environment variables set the same
settings (the option wins)."""

from __future__ import annotations

import re
from typing import Literal, get_args, get_origin

import pytest
import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from typer.testing import CliRunner

from devtools import local_run
from services.cli import app
from services.common.settings_cli import env_var, settings_command
from services.history.settings import HistorySettings
from services.rollout.settings import WorkerSettings
from services.router.settings import RouterSettings
from services.scheduler.settings import SchedulerSettings

COMMANDS = {"history": HistorySettings, "scheduler": SchedulerSettings, "worker": WorkerSettings,
            "router": RouterSettings, "local-run": local_run.LocalRunSettings}


def help_text(command: str) -> str:
    """`make run`'s driver is an app of its own (devtools), the services' commands are `rhymerl`'s."""
    argv = ["--help"] if command == "local-run" else [command, "--help"]
    result = CliRunner().invoke(local_run.app if command == "local-run" else app, argv, terminal_width=400,
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", result.output)  # help wraps long lines


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_setting_with_env_var_default_and_choices(command):
    cls, text = COMMANDS[command], help_text(command)
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert f"[env: {env_var(cls, name)}]" in text, name
        assert field.description, f"{cls.__name__}.{name} has no description"
        assert field.description.split()[0] in text
        if get_origin(field.annotation) is Literal:
            assert "<" + "|".join(get_args(field.annotation)) + ">" in text, name
    assert text.count("[default:") >= len(cls.model_fields)


def test_scheduler_policy_lists_the_registered_policies():
    from services.scheduler.policies import POLICIES

    assert "--policy <" + "|".join(POLICIES) + ">" in help_text("scheduler")


class Toy(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOY_")

    port: int = Field(5, le=10, description="A port.")
    mode: Literal["a", "b"] = Field("a", description="A mode.")
    fast: bool = Field(False, description="A flag.")


@pytest.fixture
def toy():
    got = []
    toy_app = typer.Typer()
    settings_command(toy_app, "run", Toy, "Toy.")(got.append)
    settings_command(toy_app, "other", Toy, "Another.")(got.append)  # a group: sub-commands are by name
    return toy_app, got


def test_options_and_environment_set_the_settings_and_the_option_wins(toy):
    toy_app, got = toy
    runner = CliRunner()
    assert runner.invoke(toy_app, ["run"], env={"TOY_PORT": "7", "TOY_FAST": "true"}).exit_code == 0
    assert got[-1] == Toy(port=7, mode="a", fast=True)
    assert runner.invoke(toy_app, ["run", "--port", "9", "--mode", "b", "--no-fast"],
                         env={"TOY_PORT": "7", "TOY_FAST": "true"}).exit_code == 0
    assert got[-1] == Toy(port=9, mode="b", fast=False)


def test_bad_values_are_refused_naming_the_option_and_variable(toy):
    toy_app, got = toy
    runner = CliRunner()
    bad_choice = runner.invoke(toy_app, ["run", "--mode", "c"])
    assert bad_choice.exit_code == 2 and "'c' is not one of 'a', 'b'" in bad_choice.output
    too_big = runner.invoke(toy_app, ["run", "--port", "11"])
    assert too_big.exit_code == 2 and "--port (TOY_PORT)" in too_big.output and "less than or equal to 10" in \
        too_big.output
    bad_env = runner.invoke(toy_app, ["run"], env={"TOY_PORT": "many"})
    assert bad_env.exit_code == 2 and "--port (TOY_PORT)" in bad_env.output
    assert not got


@pytest.mark.parametrize("command,env,says", [
    ("scheduler", {"RHYMERL_SCHEDULER_PORT": "70000"}, "--port (RHYMERL_SCHEDULER_PORT): Input should be less"),
    ("worker", {"RHYMERL_WORKER_PORT": "-1"}, "--port (RHYMERL_WORKER_PORT): Input should be greater"),
    ("router", {"RHYMERL_ROUTER_METRICS_PORT": "65536"}, "--metrics-port (RHYMERL_ROUTER_METRICS_PORT)"),
    ("scheduler", {"RHYMERL_SCHEDULER_WORKERS": "garbage::"}, "'garbage::' is not host:port"),
    ("scheduler", {"RHYMERL_SCHEDULER_MAX_SAMPLES_IN_FLIGHT": "0"}, "RHYMERL_SCHEDULER_MAX_SAMPLES_IN_FLIGHT"),
    ("scheduler", {"RHYMERL_SCHEDULER_CHUNK_TOKENS": "-5"}, "RHYMERL_SCHEDULER_CHUNK_TOKENS"),
    ("scheduler", {"RHYMERL_SCHEDULER_MAX_ATTEMPTS": "0"}, "RHYMERL_SCHEDULER_MAX_ATTEMPTS"),
    ("worker", {"RHYMERL_WORKER_BLOCK_SIZE": "0"}, "RHYMERL_WORKER_BLOCK_SIZE"),
    ("worker", {"RHYMERL_WORKER_MAX_NUM_SEQS": "0"}, "RHYMERL_WORKER_MAX_NUM_SEQS"),
    ("worker", {"RHYMERL_WORKER_MAX_DRAFT_LEN": "-1"}, "RHYMERL_WORKER_MAX_DRAFT_LEN"),
    ("worker", {"RHYMERL_WORKER_DEVICE": "tpu"}, "--device (RHYMERL_WORKER_DEVICE): String should match"),
    # the TLS pair, named by the service's own variables (a shared settings class says them)
    ("scheduler", {"RHYMERL_SCHEDULER_TLS_CERT_FILE": "/x"}, "(RHYMERL_SCHEDULER_TLS_CERT_FILE, "
                                                             "RHYMERL_SCHEDULER_TLS_KEY_FILE) must be set together"),
    ("worker", {"RHYMERL_WORKER_TLS_CERT_FILE": "/nonexistent.crt", "RHYMERL_WORKER_TLS_KEY_FILE": "/x.key"},
     "--tls-cert-file (RHYMERL_WORKER_TLS_CERT_FILE): no such file: /nonexistent.crt"),
])
def test_a_service_with_a_bad_setting_exits_at_once_with_one_line_naming_its_variable(command, env, says):
    result = CliRunner().invoke(app, [command], env=env, terminal_width=400)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("option,value", [("--batch-invariant", None), ("--num-kv-blocks", "512"),
                                          ("--block-size", "32"), ("--no-measure-cost", None)])
def test_a_setting_vllm_never_reads_is_refused_with_engine_vllm_naming_it(option, value, monkeypatch):
    """batch_invariant promises bitwise results, num_kv_blocks / block_size size a cache and
    measure_cost prices drafts: vLLM's engine reads none of them, so setting one with
    --engine vllm (as an option or its environment variable) is refused naming it, not
    accepted and ignored. Their defaults pass; rhymerl's engine takes the value."""
    from services.rollout.settings import VLLM_IGNORES

    name = option.removeprefix("--").removeprefix("no-").replace("-", "_")
    assert name in VLLM_IGNORES
    named = f"--{name.replace('_', '-')} (RHYMERL_WORKER_{name.upper()})"
    result = CliRunner().invoke(app, ["worker", "--engine", "vllm", option, *([value] if value else [])])
    assert result.exit_code == 2 and named in result.output and "--engine vllm" in result.output, result.output
    monkeypatch.setenv(f"RHYMERL_WORKER_{name.upper()}", value or ("false" if option.startswith("--no-") else "true"))
    with pytest.raises(ValueError, match=re.escape(named)):
        WorkerSettings(engine="vllm")
    assert getattr(WorkerSettings(engine="rhymerl"), name) != WorkerSettings.model_fields[name].default
    monkeypatch.delenv(f"RHYMERL_WORKER_{name.upper()}")
    assert WorkerSettings(engine="vllm").engine == "vllm"


def test_top_help_shows_each_command_whole_and_log_level_has_its_variable():
    text = help_text("history")
    assert "[env: RHYMERL_HISTORY_LOG_LEVEL]" in text
    top = CliRunner().invoke(app, ["--help"], terminal_width=80, env={"COLUMNS": "80"}).output
    assert "Run the history service (earlier rollouts per prompt, in Redis)." in re.sub(r"\s+", " ", top)
    assert "in..." not in top  # cut short, as it was


def test_the_readmes_sharded_schedulers_on_one_machine_bind_ports_of_their_own():
    """The README's scale-out commands, run as written on one machine: no two processes
    bind the same port (a second scheduler once kept the first's health and metrics
    ports, and could not start). Ports an option does not set are the defaults."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [block] = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL) if "--shard-registry-url" in b]
    owners: dict[int, str] = {}
    commands = [line.split("#")[0] for line in block.splitlines() if line.startswith("rhymerl ")]
    assert [c.split()[1] for c in commands].count("scheduler") >= 2
    for i, line in enumerate(commands):
        command = line.split()[1]
        cls = COMMANDS[command]
        given = {name.replace("-", "_"): value for name, value in re.findall(r"--([a-z-]+)\s+(\S+)", line)}
        assert set(given) <= set(cls.model_fields), line
        for field in ("port", "metrics_port", "health_port"):
            port = int(given.get(field, cls.model_fields[field].default))
            if port:
                who = f"line {i + 1} ({command}) --{field.replace('_', '-')}"
                assert port not in owners, f"{who} binds {port}, as {owners[port]} does"
                owners[port] = who


def test_docs_vllm_names_every_setting_refused_with_engine_vllm():
    """docs/vllm.md's list of the settings refused with ENGINE=vllm is VLLM_IGNORES (it had
    left out TREE_DRAFTS and OVERLAP, which the worker refuses too)."""
    from pathlib import Path

    from services.rollout.settings import VLLM_IGNORES

    text = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    (paragraph,) = [block for block in text.split("\n\n") if "are refused with `ENGINE=vllm`" in block]
    assert [name for name in VLLM_IGNORES if f"`{name.upper()}`" not in paragraph] == []
