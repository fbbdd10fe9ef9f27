"""The chart, docker-compose and the docs speak one vocabulary, and the documented
8-GPU-node example installs what it promises.

If these fail, a user who reads a setting's name in one place (a Helm value, a compose
variable, docs/deploy.md) finds another name or nothing in the next, or copies an
example that would not schedule on their node.
"""

from __future__ import annotations

import json
import re
import typing

import pytest
import yaml
from chart_render import HERE
from test_chart import REPO, SETTINGS, component, container, env_of, workload

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
VALUES = yaml.safe_load((HERE.parent / "rhymerl" / "values.yaml").read_text())
EXAMPLE_8GPU = HERE / "values-8gpu-node.yaml"

# Settings the chart derives instead of reading a value of the same name: the bind host,
# the addresses of the other services, the pod's own name and IP, and the model path
# (a value of worker.model, next to the volume that holds it), and the scheduler's weight
# store (the path of the volume the chart mounts for it), and the release's one Redis key
# prefix (history.keyPrefix, which the scheduler and router share).
DERIVED = {"HOST", "HISTORY_ADDRESS", "SCHEDULER_ADDRESS", "ID", "ADVERTISE_ADDRESS", "MODEL_PATH", "WEIGHTS_DIR",
           "KEY_PREFIX"}


@pytest.fixture(scope="module")
def default_objects(render):
    return render()


def camel(suffix: str) -> str:
    """NUM_KV_BLOCKS -> numKvBlocks: the Helm value named after a setting."""
    head, *rest = suffix.lower().split("_")
    return head + "".join(w.capitalize() for w in rest)


def chart_env(objects, name) -> dict:
    return env_of(container(workload(objects, name), name))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_the_chart_sets_is_a_value_of_the_same_name(name, default_objects):
    """RHYMERL_SCHEDULER_CHUNK_TOKENS is scheduler.chunkTokens, and so on for every setting."""
    prefix = SETTINGS[name].model_config["env_prefix"]
    for var in chart_env(default_objects, name):
        if not var.startswith(prefix):
            continue
        suffix = var[len(prefix):]
        if suffix in DERIVED:
            continue
        assert camel(suffix) in VALUES[name], f"{var} has no value {name}.{camel(suffix)}"
    assert VALUES["worker"]["model"]["path"] == COMPOSE["worker"]["environment"]["RHYMERL_WORKER_MODEL_PATH"]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_compose_sets_the_same_settings_as_the_chart(name, default_objects):
    """Same RHYMERL_* names per service; compose's worker derives its address in its command."""
    ours = {k for k in COMPOSE[name]["environment"] if k.startswith("RHYMERL_")}
    chart = {k for k in chart_env(default_objects, name) if k.startswith("RHYMERL_")}
    per_pod = {"RHYMERL_WORKER_ID", "RHYMERL_WORKER_ADVERTISE_ADDRESS"} if name == "worker" else set()
    assert ours == chart - per_pod, (ours ^ (chart - per_pod))
    if name == "worker":
        assert "RHYMERL_WORKER_ADVERTISE_ADDRESS=" in " ".join(COMPOSE["worker"]["command"])


def test_compose_overrides_are_named_after_the_setting_they_set():
    """`RHYMERL_SCHEDULER_POLICY: ${RHYMERL_SCHEDULER_POLICY:-rhymerl}`, never another name."""
    for name in SETTINGS:
        for key, value in COMPOSE[name]["environment"].items():
            for var in re.findall(r"\$\{([A-Z0-9_]+)", str(value)):
                if key.startswith("RHYMERL_"):
                    assert var == key, (name, key, var)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_choice_of_a_setting_is_a_choice_of_its_value(name):
    """A value named after a setting with choices (worker.dtype: RHYMERL_WORKER_DTYPE) offers
    every choice the service takes, and no other: values.schema.json refused
    worker.dtype=float16, which the worker runs (GPUs without bfloat16)."""
    schema = json.loads((HERE.parent / "rhymerl" / "values.schema.json").read_text())["properties"][name]
    cls = SETTINGS[name]
    for field, info in cls.model_fields.items():
        value = schema["properties"].get(camel(field.upper()))
        if value is None or typing.get_origin(info.annotation) is not typing.Literal:
            continue
        assert set(value["enum"]) == set(typing.get_args(info.annotation)), f"{name}.{camel(field.upper())}"


@pytest.mark.parametrize("name", ["history", "scheduler"])
def test_compose_and_chart_defaults_agree(name, default_objects):
    """History and scheduler behave the same under compose and the chart's defaults (the
    worker's differ on purpose: compose runs CPU workers with a tiny model)."""
    env = chart_env(default_objects, name)
    for key, value in COMPOSE[name]["environment"].items():
        match = re.fullmatch(r"\$\{[A-Z0-9_]+:-(.*)\}", str(value))
        if match and isinstance(env.get(key), str):
            assert env[key] == match.group(1), (key, env[key], match.group(1))


def test_docs_map_every_chart_setting_to_its_value():
    """docs/deploy.md's table names every setting the chart sets."""
    doc = (REPO / "docs" / "deploy.md").read_text()
    for name, cls in SETTINGS.items():
        prefix = cls.model_config["env_prefix"]
        for var in COMPOSE[name]["environment"]:
            if var.startswith(prefix) and var not in {prefix + "HOST"}:
                suffix = var[len(prefix):]
                assert var in doc or f"`_{suffix}`" in doc, var


# --- the 8-GPU node example (docs/deploy.md) ----------------------------------------------

@pytest.fixture(scope="module")
def node_objects(render):
    return render(EXAMPLE_8GPU)


def test_8gpu_node_example_is_valid(node_objects, validate):
    for obj in node_objects:
        validate(obj)


def test_8gpu_node_example_runs_one_worker_per_gpu_on_that_node(node_objects):
    worker = workload(node_objects, "worker")
    assert worker["spec"]["replicas"] == 8
    c = container(worker, "worker")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pod = worker["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-0"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    volume = next(v for v in pod["volumes"] if v["name"] in ("model", "model-source"))
    assert volume == {"name": volume["name"], "hostPath": {"path": "/data/checkpoints", "type": "Directory"}}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] and mount["subPath"] == "qwen2.5-7b-instruct"
    assert env_of(c)["RHYMERL_WORKER_DEVICE"] == "cuda"
    assert {component(o) for o in node_objects if o["kind"] == "StatefulSet"} == {"redis"}


def test_8gpu_node_example_is_documented():
    doc = (REPO / "docs" / "deploy.md").read_text()
    assert "helm/tests/values-8gpu-node.yaml" in doc
