"""docker-compose.yml wires the services with the settings they actually read.

No Docker engine runs in CI, so this checks the file itself: a misspelled RHYMERL_*
variable (pydantic-settings ignores it silently), an address or port that does not
match the service it names, a worker that would be killed mid-drain, a mount of a
file that does not exist, a service running as root.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.history.settings import HistorySettings
from services.rollout.settings import WorkerSettings
from services.scheduler.settings import SchedulerSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
SETTINGS = {"history": HistorySettings, "scheduler": SchedulerSettings, "worker": WorkerSettings}
# The scheduler's compose health is "takes registrations": workers start after it, and its
# RolloutService is unready until they register.
HEALTH_NAMES = {"history": "rhymerl.v1.HistoryService", "scheduler": "rhymerl.v1.RegistryService",
                "worker": "rhymerl.v1.WorkerService"}


def env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[service]["environment"].items()}


def default(value: str) -> str:
    """`${VAR:-default}` -> default (what compose uses when VAR is unset)."""
    match = re.fullmatch(r"\$\{[A-Z0-9_]+:-(.*)\}", value)
    return match.group(1) if match else value


def setting_names(service: str) -> set[str]:
    cls = SETTINGS[service]
    return {cls.model_config["env_prefix"] + name.upper() for name in cls.model_fields}


def test_env_names_are_settings_of_the_service():
    for service in SETTINGS:
        ours = {k for k in env(service) if k.startswith("RHYMERL_")}
        assert ours, service
        assert ours <= setting_names(service), ours - setting_names(service)


def test_env_values_parse_as_the_settings():
    """What compose passes (with its defaults) is accepted by each service's settings."""
    for service, cls in SETTINGS.items():
        prefix = cls.model_config["env_prefix"]
        values = {k[len(prefix):].lower(): default(v) for k, v in env(service).items() if k.startswith(prefix)}
        cls.model_validate(values)


def test_addresses_and_ports_line_up():
    history_port = HistorySettings.model_fields["port"].default
    scheduler_port = SchedulerSettings.model_fields["port"].default
    assert env("history")["RHYMERL_HISTORY_PORT"] == str(history_port)
    assert env("scheduler")["RHYMERL_SCHEDULER_PORT"] == str(scheduler_port)
    assert env("scheduler")["RHYMERL_SCHEDULER_HISTORY_ADDRESS"] == f"history:{history_port}"
    assert env("worker")["RHYMERL_WORKER_SCHEDULER_ADDRESS"] == f"scheduler:{scheduler_port}"
    assert env("worker")["RHYMERL_WORKER_HISTORY_ADDRESS"] == f"history:{history_port}"
    assert env("history")["RHYMERL_HISTORY_REDIS_URL"].startswith("redis://redis:6379/")
    assert f"{scheduler_port}:{scheduler_port}" in SERVICES["scheduler"]["ports"]


def test_healthchecks_ask_each_service_by_name():
    """On the service's port; the scheduler's on the port of its health process (answered
    off its event loop)."""
    for service, name in HEALTH_NAMES.items():
        prefix = SETTINGS[service].model_config["env_prefix"]
        port = env(service).get(prefix + "HEALTH_PORT") if service == "scheduler" else env(service)[prefix + "PORT"]
        assert SERVICES[service]["healthcheck"]["test"] == ["CMD", "rhymerl-healthcheck", f"localhost:{port}", name]


def test_workers_scale_and_drain():
    worker = SERVICES["worker"]
    assert default(str(worker["deploy"]["replicas"])) == "2"
    # the deregistration (up to 5 s) and the server's stop (1 s) come on top of the drain
    grace = int(default(worker["stop_grace_period"]).rstrip("s"))
    assert grace >= float(default(env("worker")["RHYMERL_WORKER_DRAIN_TIMEOUT_S"])) + 10
    # each replica advertises its own address: the service name would resolve to all of them
    assert "RHYMERL_WORKER_ADVERTISE_ADDRESS=" in worker["command"][0]
    assert "container_name" not in worker and "ports" not in worker


def test_images_are_built_from_the_deploy_dockerfiles():
    for service, dockerfile in [("history", "Dockerfile.service"), ("scheduler", "Dockerfile.service"),
                                ("worker", "Dockerfile.worker-cpu")]:
        build = SERVICES[service]["build"]
        assert build["context"] == "." and build["dockerfile"] == f"deploy/{dockerfile}"
        assert (REPO / build["dockerfile"]).exists()


def test_bind_mounts_exist_and_rhymerl_containers_are_locked_down():
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
    for name in SETTINGS:
        service = SERVICES[name]
        assert service["read_only"] is True and "/tmp" in service["tmpfs"]
        assert service["cap_drop"] == ["ALL"]
    assert SERVICES["redis"]["user"].split(":")[0] != "0"
