"""The Helm chart renders valid Kubernetes objects that run rhymerl as designed.

Two profiles: the chart's defaults (CPU workers, bundled Redis) and values-gpu.yaml
(GPU workers, external Redis, Prometheus Operator). Each object is validated against
the Kubernetes API types (conftest.validate); then the properties that matter are
asserted: GPUs, gRPC probes, drain time, env names, disruption budgets, policies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from chart_render import CHART, HERE, MONITORING_API, RenderError, check_type

from services.history.settings import HistorySettings
from services.rollout.settings import WorkerSettings
from services.scheduler.settings import SchedulerSettings

GPU_VALUES = HERE / "values-gpu.yaml"
REPO = HERE.parent.parent
WORKLOADS = {"Deployment", "StatefulSet"}
HEALTH_SERVICES = {"history": "rhymerl.v1.HistoryService", "scheduler": "rhymerl.v1.RolloutService",
                   "worker": "rhymerl.v1.WorkerService"}
SETTINGS = {"history": HistorySettings, "scheduler": SchedulerSettings, "worker": WorkerSettings}


@pytest.fixture(scope="module")
def default_objects(render):
    return render()


@pytest.fixture(scope="module")
def gpu_objects(render):
    return render(GPU_VALUES, api_versions=[MONITORING_API])


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def component(obj) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def workload(objects, name) -> dict:
    return next(o for o in objects if o["kind"] in WORKLOADS and component(o) == name)


def container(obj, name=None) -> dict:
    containers = obj["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def env_of(c) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def settings_env_names(kind: str) -> set[str]:
    cls = SETTINGS[kind]
    prefix = cls.model_config["env_prefix"]
    return {prefix + field.upper() for field in cls.model_fields}


# --- every object is valid -------------------------------------------------------------

CRD_SHAPES = {
    # What this chart may put in each Prometheus Operator spec (monitoring.coreos.com/v1).
    "ServiceMonitor": {"selector", "namespaceSelector", "endpoints", "jobLabel"},
    "PodMonitor": {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel"},
    "PrometheusRule": {"groups"},
}
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "replacement", "action", "modulus"}


def check_monitoring(obj):
    assert obj["apiVersion"] == MONITORING_API
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    errors: list[str] = []
    check_type(obj["metadata"], "V1ObjectMeta", "metadata", errors)
    spec = obj["spec"]
    assert set(spec) <= CRD_SHAPES[obj["kind"]], set(spec) - CRD_SHAPES[obj["kind"]]
    if obj["kind"] == "PrometheusRule":
        for group in spec["groups"]:
            assert set(group) <= {"name", "interval", "rules"}
            for rule in group["rules"]:
                assert set(rule) <= {"record", "alert", "expr", "for", "labels", "annotations"}
                assert ("record" in rule) != ("alert" in rule)
        return
    check_type(spec["selector"], "V1LabelSelector", "spec.selector", errors)
    assert not errors, errors
    assert set(spec["namespaceSelector"]) <= {"matchNames", "any"}
    for endpoint in spec.get("endpoints", []) + spec.get("podMetricsEndpoints", []):
        assert set(endpoint) <= ENDPOINT_FIELDS, set(endpoint) - ENDPOINT_FIELDS
        assert endpoint["port"] == "metrics"
        for relabel in endpoint.get("relabelings", []):
            assert set(relabel) <= RELABEL_FIELDS


@pytest.mark.parametrize("profile", ["default", "production"])
def test_every_object_is_a_valid_kubernetes_object(profile, default_objects, gpu_objects, validate):
    """A field Kubernetes does not know (or an unquoted env value) would be rejected at install."""
    objects = default_objects if profile == "default" else gpu_objects
    assert objects
    for obj in objects:
        if obj["apiVersion"] == MONITORING_API:
            check_monitoring(obj)
        else:
            validate(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "two objects with the same kind and name"


TOGGLES = [
    {"serviceAccount.create": False, "networkPolicy.enabled": False},
    {"history.pdb.enabled": False, "worker.pdb.enabled": False, "worker.replicas": 0},
    {"redis.persistence.enabled": False, "redis.maxmemory": "2gb", "redis.persistence.storageClass": "fast"},
    {"redis.enabled": False, "history.redisUrl": ""},  # embedded redis-server in the history pod
    {"fullnameOverride": "rl", "commonLabels.team": "post-training", "worker.podAnnotations.a": "b",
     "worker.priorityClassName": "high", "scheduler.service.type": "LoadBalancer"},
    {"worker.model.volume": None, "worker.model.volume.hostPath.path": "/data/models",
     "worker.model.subPath": "tiny", "worker.gpusPerPod": 2},
]


@pytest.mark.parametrize("overrides", TOGGLES, ids=lambda o: ",".join(o))
def test_every_toggle_renders_valid_objects(render, validate, overrides):
    """The non-default branches of the templates produce valid objects too."""
    objects = render(set=overrides)
    for obj in objects:
        validate(obj)
    assert workload(objects, "worker")["spec"]["replicas"] == overrides.get("worker.replicas", 2)


def test_validator_rejects_what_the_api_server_would(validate):
    """The validation above is only worth something if it fails on real mistakes."""
    good = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "1"}}
    validate(good)
    mistakes = [
        {**good, "dataa": {}},                                   # unknown field
        {**good, "data": {"a": 1}},                              # number where a string is due
        {**good, "metadata": {"name": "x", "label": {}}},        # unknown nested field
    ]
    for bad in mistakes:
        with pytest.raises(AssertionError):
            validate(bad)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "env": [{"name": "PORT", "value": 50051}]}]}}
    with pytest.raises(AssertionError, match="env\\[0\\].value"):
        validate(pod)


def test_expected_objects_per_profile(default_objects, gpu_objects):
    """The default profile bundles Redis and no monitoring CRDs; the GPU profile the opposite."""
    default_kinds = {(o["kind"], component(o)) for o in default_objects}
    assert ("StatefulSet", "redis") in default_kinds
    assert not any(o["apiVersion"] == MONITORING_API for o in default_objects)
    gpu_kinds = {o["kind"] for o in gpu_objects}
    assert {"ServiceMonitor", "PrometheusRule"} <= gpu_kinds
    assert "StatefulSet" not in gpu_kinds  # external Redis
    for objects in (default_objects, gpu_objects):
        for name in ("history", "scheduler", "worker"):
            assert workload(objects, name)["kind"] == "Deployment"
            assert any(o["kind"] == "Service" and component(o) == name for o in objects)


# --- values and their schema --------------------------------------------------------------

def schema_errors(value, schema, path="") -> list[str]:
    """The subset of JSON Schema that values.schema.json uses (Helm validates with the full one)."""
    errors = []
    types = schema.get("type")
    if types:
        types = types if isinstance(types, list) else [types]
        py = {"object": dict, "array": list, "string": str, "boolean": bool,
              "integer": int, "number": (int, float)}
        ok = any(isinstance(value, py[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        if not ok:
            return [f"{path}: {value!r} is not {types}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}.{key}: required")
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}.{key}: not in the schema")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def undocumented(schema, path="") -> list[str]:
    missing = [] if schema.get("description") else [path or "<root>"]
    for key, sub in schema.get("properties", {}).items():
        missing += undocumented(sub, f"{path}.{key}")
    return missing


def deep_merge(base, override):
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_schema_describes_every_value_and_accepts_both_profiles():
    """Every value is documented (values.schema.json descriptions) and both profiles are valid."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert undocumented(schema) == []
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema_errors(defaults, schema) == []
    gpu = deep_merge(defaults, yaml.safe_load(GPU_VALUES.read_text()))
    assert schema_errors(gpu, schema) == []
    # and it does reject typos and bad enums
    assert schema_errors(deep_merge(defaults, {"worker": {"replica": 3}}), schema)
    assert schema_errors(deep_merge(defaults, {"scheduler": {"policy": "fifo"}}), schema)


# --- what the services need ---------------------------------------------------------------

def test_gpu_profile_requests_gpus_and_lands_on_gpu_nodes(gpu_objects, default_objects):
    """Without nvidia.com/gpu the device plugin gives the worker no GPU; CPU defaults ask for none."""
    worker = workload(gpu_objects, "worker")
    c = container(worker, "worker")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pod = worker["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nvidia.com/gpu.product" in pod["nodeSelector"]
    assert c["image"].startswith("registry.example.com/rhymerl/worker:")
    default_worker = container(workload(default_objects, "worker"))
    assert "nvidia.com/gpu" not in default_worker["resources"].get("limits", {})


def test_gpus_per_pod_sets_the_gpu_limit(render):
    worker = workload(render(GPU_VALUES, set={"worker.gpusPerPod": 8}), "worker")
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize("profile", ["default", "production"])
def test_probes_are_grpc_health_checks_on_the_grpc_port(profile, default_objects, gpu_objects):
    """Kubernetes' grpc probes call grpc.health.v1 on the service's own port and name
    (with TLS, on the plaintext health-only port: the production profile); the
    scheduler's always on the port of its health process, which answers off its busy
    event loop."""
    objects = default_objects if profile == "default" else gpu_objects
    for name, service in HEALTH_SERVICES.items():
        c = container(workload(objects, name), name)
        env = env_of(c)
        prefix = SETTINGS[name].model_config["env_prefix"]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        settings_port = SETTINGS[name].model_fields["port"].default
        assert grpc_port == settings_port
        assert env[prefix + "PORT"] == str(grpc_port)
        probed = 8086 if profile == "production" else grpc_port
        if name == "scheduler":
            probed = SETTINGS[name].model_fields["health_port"].default
            assert env[prefix + "HEALTH_PORT"] == str(probed)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
            assert c[probe]["grpc"]["port"] == probed
        assert c["readinessProbe"]["grpc"]["service"] == service


def test_worker_startup_probe_outlasts_a_model_load(default_objects, gpu_objects):
    """Liveness must not kill a worker that is still loading weights and capturing graphs."""
    for objects in (default_objects, gpu_objects):
        probe = container(workload(objects, "worker"))["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 15 * 60


def test_termination_grace_covers_the_drain(default_objects, gpu_objects, render):
    """SIGKILL before the drain ends would lose the worker's running sequences."""
    for objects in (default_objects, gpu_objects):
        worker = workload(objects, "worker")
        drain = float(env_of(container(worker))["RHYMERL_WORKER_DRAIN_TIMEOUT_S"])
        # the deregistration (up to 5 s) and the server's stop (1 s) come on top of the drain
        assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 10
    with pytest.raises(RenderError, match="terminationGracePeriodSeconds"):
        render(set={"worker.drainTimeoutS": 300, "worker.terminationGracePeriodSeconds": 60})
    with pytest.raises(RenderError, match="drainTimeoutS \\+ 10"):  # equal: SIGKILL at the drain's end
        render(set={"worker.drainTimeoutS": 80.5, "worker.terminationGracePeriodSeconds": 90})
    render(set={"worker.drainTimeoutS": 80, "worker.terminationGracePeriodSeconds": 90})


def test_worker_replicas_is_the_scaling_knob(render, default_objects):
    assert workload(default_objects, "worker")["spec"]["replicas"] == 2
    assert workload(render(set={"worker.replicas": 7}), "worker")["spec"]["replicas"] == 7


@pytest.mark.parametrize("profile", ["default", "production"])
def test_env_names_are_the_services_settings(profile, default_objects, gpu_objects):
    """A misspelled RHYMERL_* variable is silently ignored by pydantic-settings: catch it here."""
    objects = default_objects if profile == "default" else gpu_objects
    for name in SETTINGS:
        env = env_of(container(workload(objects, name), name))
        prefix = SETTINGS[name].model_config["env_prefix"]
        ours = {k for k in env if k.startswith("RHYMERL_")}
        assert ours <= settings_env_names(name), ours - settings_env_names(name)
        assert {k for k in ours if not k.startswith(prefix)} == set()
    worker_env = env_of(container(workload(objects, "worker"), "worker"))
    assert worker_env["RHYMERL_WORKER_ADVERTISE_ADDRESS"] == "$(POD_IP):50061"
    assert worker_env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert worker_env["RHYMERL_WORKER_SCHEDULER_ADDRESS"] == "rhymerl-scheduler:50051"
    assert worker_env["RHYMERL_WORKER_HISTORY_ADDRESS"] == "rhymerl-history:50052"
    scheduler_env = env_of(container(workload(objects, "scheduler")))
    assert scheduler_env["RHYMERL_SCHEDULER_HISTORY_ADDRESS"] == "rhymerl-history:50052"


def test_every_documented_setting_is_exposed(default_objects):
    """The settings the chart promises (docs/deploy.md) are all set on the containers."""
    exposed = {
        "history": {"HOST", "PORT", "METRICS_PORT", "REDIS_URL", "NUM_EPOCHS", "TTL_SECONDS", "KEY_PREFIX"},
        "scheduler": {"HOST", "PORT", "METRICS_PORT", "HISTORY_ADDRESS", "WORKERS", "POLICY", "CHUNK_TOKENS",
                      "WORKER_TIMEOUT_S"},
        "worker": {"HOST", "PORT", "METRICS_PORT", "ID", "ADVERTISE_ADDRESS", "MODEL_PATH", "DEVICE", "DTYPE",
                   "MAX_NUM_SEQS", "NUM_KV_BLOCKS", "SPECULATIVE", "BATCH_INVARIANT", "SCHEDULER_ADDRESS",
                   "HISTORY_ADDRESS", "DRAIN_TIMEOUT_S"},
    }
    for name, suffixes in exposed.items():
        prefix = SETTINGS[name].model_config["env_prefix"]
        env = env_of(container(workload(default_objects, name), name))
        assert {prefix + s for s in suffixes} <= set(env)


def test_redis_choices(render, gpu_objects, default_objects):
    """Bundled Redis by default, a Secret in the GPU profile, embedded only for one history pod."""
    url = env_of(container(workload(default_objects, "history")))["RHYMERL_HISTORY_REDIS_URL"]
    assert url == "redis://rhymerl-redis:6379/0"
    secret = env_of(container(workload(gpu_objects, "history")))["RHYMERL_HISTORY_REDIS_URL"]
    assert secret == {"secretKeyRef": {"name": "rhymerl-redis", "key": "url"}}
    external = render(set={"redis.enabled": False, "history.redisUrl": "redis://cache:6379/2"})
    assert env_of(container(workload(external, "history")))["RHYMERL_HISTORY_REDIS_URL"] == "redis://cache:6379/2"
    assert not by_kind(external, "StatefulSet")
    with pytest.raises(RenderError, match="shared Redis"):
        render(set={"redis.enabled": False, "history.replicas": 2})
    with pytest.raises(RenderError, match="choose one Redis"):
        render(set={"history.redisUrl": "redis://cache:6379/2"})


def test_model_volume_mounted_or_copied(default_objects, gpu_objects):
    """The worker reads the checkpoint at RHYMERL_WORKER_MODEL_PATH, directly or after the init copy."""
    direct = workload(default_objects, "worker")["spec"]["template"]["spec"]
    mount = next(m for m in direct["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount["mountPath"] == env_of(direct["containers"][0])["RHYMERL_WORKER_MODEL_PATH"]
    assert mount["readOnly"] is True
    assert "initContainers" not in direct
    copied = workload(gpu_objects, "worker")["spec"]["template"]["spec"]
    init = copied["initContainers"][0]
    volumes = {v["name"]: v for v in copied["volumes"]}
    assert volumes["model"]["emptyDir"]["sizeLimit"] == "40Gi"
    assert volumes["model-source"]["persistentVolumeClaim"]["claimName"] == "checkpoints"
    source = next(m for m in init["volumeMounts"] if m["name"] == "model-source")
    assert source["subPath"] == "qwen2.5-7b-instruct"
    assert init["command"][-1] == "/models/policy"


@pytest.mark.parametrize("profile", ["default", "production"])
def test_pods_run_as_non_root_with_read_only_root(profile, default_objects, gpu_objects):
    objects = default_objects if profile == "default" else gpu_objects
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] in WORKLOADS]
    pods += [o["spec"] for o in objects if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("profile", ["default", "production"])
def test_services_and_budgets_select_their_pods(profile, default_objects, gpu_objects):
    """A selector that matches no pod gives a Service without endpoints, a PDB that protects nothing."""
    objects = default_objects if profile == "default" else gpu_objects
    pods = {component(o): o["spec"]["template"] for o in objects if o["kind"] in WORKLOADS}
    for svc in by_kind(objects, "Service").values():
        template = pods[component(svc)]
        assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        port_names = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    pdbs = by_kind(objects, "PodDisruptionBudget")
    assert {component(p) for p in pdbs.values()} == {"history", "worker"}
    for pdb in pdbs.values():
        labels = pods[component(pdb)]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def ingress_peers(policy) -> list[str | None]:
    """The component each ingress peer selects (None for any other peer)."""
    return [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            for rule in policy["spec"]["ingress"] for p in rule.get("from", [])]


@pytest.mark.parametrize("profile", ["default", "production"])
def test_network_policies_allow_only_the_service_graph(profile, default_objects, gpu_objects):
    objects = default_objects if profile == "default" else gpu_objects
    policies = {component(p): p for p in by_kind(objects, "NetworkPolicy").values()}
    assert {"history", "scheduler", "worker"} <= set(policies)
    assert set(ingress_peers(policies["worker"])) <= {"scheduler", None}
    assert {"scheduler", "worker"} <= set(ingress_peers(policies["history"]))
    if "redis" in policies:
        assert sorted(ingress_peers(policies["redis"])) == ["history", "scheduler"]  # scheduler: its step log
    if profile == "production":  # clientFrom restricts the scheduler, but workers must still register
        assert {"worker", None} <= set(ingress_peers(policies["scheduler"]))


def test_prometheus_rule_is_the_compose_rules_file(gpu_objects):
    """Kubernetes and docker-compose record the same series the dashboards read."""
    rule = next(o for o in gpu_objects if o["kind"] == "PrometheusRule")
    compose_rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())
    assert rule["spec"] == compose_rules
    assert (CHART / "files" / "prometheus-rules.yml").read_text() == \
        (REPO / "deploy" / "prometheus" / "rules.yml").read_text()


def test_pod_monitor_alternative(render):
    objects = render(set={"metrics.podMonitor.enabled": True})
    pm = next(o for o in objects if o["kind"] == "PodMonitor")
    check_monitoring(pm)
    assert pm["spec"]["selector"]["matchExpressions"][0]["values"] == ["history", "scheduler", "worker"]


def test_helm_test_pod_checks_scheduler_health(default_objects):
    pod = next(o for o in default_objects if o["kind"] == "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["containers"][0]["command"] == [
        "rhymerl-healthcheck", "rhymerl-scheduler:50051", "rhymerl.v1.RolloutService"]


def policy_admits_test_pod(policy, port_name: str) -> bool:
    """Whether an ingress rule of ``policy`` lets the `helm test` pod reach ``port_name``."""
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        peers = [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                 for p in rule.get("from", [])]
        if port_name in ports and ("from" not in rule or "test" in peers):
            return True
    return False


@pytest.mark.parametrize("sharded", [False, True])
def test_with_tls_helm_test_asks_the_plaintext_health_port_through_service_and_network_policy(
        sharded, render, validate):
    """rhymerl-healthcheck speaks plaintext: with tls.enabled (the production profile) the
    gRPC port would fail `helm test`. The pod asks the health port instead (the scheduler's
    health process; sharded: the router's), which its Service exposes and its
    NetworkPolicy admits from the test pod."""
    objects = render(GPU_VALUES, set={"sharding.enabled": sharded, "sharding.shards": 2},
                     api_versions=[MONITORING_API])
    name, health_port = ("router", 8086) if sharded else ("scheduler", 50053)
    pod = next(o for o in objects if o["kind"] == "Pod")
    host, port = pod["spec"]["containers"][0]["command"][1].rsplit(":", 1)
    assert (host, int(port)) == (f"rhymerl-{name}", health_port)
    assert pod["spec"]["containers"][0]["command"][2] == "rhymerl.v1.RolloutService"
    service = by_kind(objects, "Service")[host]
    [svc_port] = [p for p in service["spec"]["ports"] if p["port"] == health_port]
    deployment = by_kind(objects, "Deployment")[host]
    c = container(deployment, name)
    [named] = [p for p in c["ports"] if p["name"] == svc_port["targetPort"]]
    assert named["containerPort"] == health_port == c["readinessProbe"]["grpc"]["port"]  # what the health process serves
    if name == "scheduler":
        assert env_of(c)["RHYMERL_SCHEDULER_HEALTH_PORT"] == str(health_port)
    else:
        assert env_of(c)["RHYMERL_ROUTER_HEALTH_PORT"] == str(health_port)
    policy = next(p for p in by_kind(objects, "NetworkPolicy").values() if component(p) == name)
    assert policy_admits_test_pod(policy, named["name"])
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "test"
    for obj in (pod, service, policy):
        validate(obj)


def test_without_tls_helm_test_asks_the_grpc_port_as_before(default_objects, render):
    objects = render(set={"networkPolicy.enabled": True, "networkPolicy.clientFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "training"}}}]})
    pod = next(o for o in objects if o["kind"] == "Pod")
    assert pod["spec"]["containers"][0]["command"][1] == "rhymerl-scheduler:50051"
    policy = next(p for p in by_kind(objects, "NetworkPolicy").values() if component(p) == "scheduler")
    assert policy_admits_test_pod(policy, "grpc")


def test_chart_refuses_clusters_without_grpc_probes(render):
    """grpc probes are GA from Kubernetes 1.27; older API servers would drop them."""
    with pytest.raises(RenderError, match="incompatible with Kubernetes v1.26"):
        render(kube_version="v1.26.5")
    assert render(kube_version="v1.27.0")


def test_names_follow_the_release(render):
    objects = render(name="prod")
    assert workload(objects, "scheduler")["metadata"]["name"] == "prod-rhymerl-scheduler"
    env = env_of(container(workload(objects, "worker")))
    assert env["RHYMERL_WORKER_SCHEDULER_ADDRESS"] == "prod-rhymerl-scheduler:50051"


def test_gpu_values_file_is_the_documented_profile():
    assert Path(GPU_VALUES).exists()
    assert "values-gpu.yaml" in (REPO / "docs" / "deploy.md").read_text()


@pytest.mark.parametrize("name", ["history", "scheduler", "worker"])
def test_tls_profile_mounts_the_certificate_and_probes_the_plaintext_health_port(name, gpu_objects):
    """With tls.enabled every service serves TLS from the Secret and verifies its peers;
    the kubelet's gRPC probes (no TLS) go to the health-only plaintext port."""
    pod = workload(gpu_objects, name)["spec"]["template"]["spec"]
    c = container(workload(gpu_objects, name), name)
    env = env_of(c)
    prefix = SETTINGS[name].model_config["env_prefix"]
    assert env[prefix + "TLS_CERT_FILE"] == "/etc/rhymerl/tls/tls.crt"
    assert env[prefix + "TLS_KEY_FILE"] == "/etc/rhymerl/tls/tls.key"
    assert env[prefix + "TLS_CA_FILE"] == "/etc/rhymerl/tls/ca.crt"
    assert env[prefix + "TLS_SERVER_NAME"] == "rhymerl.internal"
    health_port = 50053 if name == "scheduler" else 8086  # the scheduler's health process has a port of its own
    assert env[prefix + "HEALTH_PORT"] == str(health_port)
    settings = SETTINGS[name].model_fields
    for var in env:
        if var.startswith(prefix):
            assert var[len(prefix):].lower() in settings, var  # the service reads what the chart sets
    assert {"name": "tls", "mountPath": "/etc/rhymerl/tls", "readOnly": True} in c["volumeMounts"]
    tls_volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"]["secretName"] == "rhymerl-tls"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health_port


def test_auth_reads_trainer_tokens_from_a_secret(gpu_objects, render, validate, tmp_path):
    env = env_of(container(workload(gpu_objects, "scheduler"), "scheduler"))
    assert env["RHYMERL_SCHEDULER_AUTH_TOKENS"] == {
        "secretKeyRef": {"name": "rhymerl-trainer-tokens", "key": "tokens"}}
    assert not [o for o in gpu_objects if o["kind"] == "Secret"]  # existingSecret: none created
    values = tmp_path / "auth.yaml"
    values.write_text(yaml.safe_dump({"auth": {"enabled": True, "tokens": ["t1", "t2"]}}))
    objects = render(values)
    [secret] = [o for o in objects if o["kind"] == "Secret"]
    validate(secret)
    assert secret["stringData"]["tokens"] == "t1,t2"
    env = env_of(container(workload(objects, "scheduler"), "scheduler"))
    assert env["RHYMERL_SCHEDULER_AUTH_TOKENS"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


@pytest.mark.parametrize("profile", ["production", "chart-made secret", "sharded"])
def test_with_auth_the_workers_present_the_token_the_schedulers_registry_asks(profile, gpu_objects, render,
                                                                             validate):
    """RegistryService shares the scheduler's port: with auth.enabled every scheduler (each
    shard too) asks the workers' token, and every worker is given it, from one Secret key."""
    if profile == "production":
        objects, secret_name = gpu_objects, "rhymerl-trainer-tokens"
    elif profile == "sharded":
        objects = render(GPU_VALUES, set={"sharding.enabled": True, "sharding.shards": 2},
                         api_versions=[MONITORING_API])
        secret_name = "rhymerl-trainer-tokens"
    else:
        objects = render(set={"auth.enabled": True, "auth.tokens": ["t1"], "auth.workerToken": "w-token"})
        [secret] = [o for o in objects if o["kind"] == "Secret"]
        validate(secret)
        assert secret["stringData"] == {"tokens": "t1", "worker-token": "w-token"}
        secret_name = secret["metadata"]["name"]
    ref = {"secretKeyRef": {"name": secret_name, "key": "worker-token"}}
    schedulers = [o for o in objects if o["kind"] in WORKLOADS and component(o) == "scheduler"]
    workers = [o for o in objects if o["kind"] in WORKLOADS and component(o) == "worker"]
    assert len(schedulers) == len(workers) == (2 if profile == "sharded" else 1)
    for s in schedulers:
        assert env_of(container(s, "scheduler"))["RHYMERL_SCHEDULER_WORKER_TOKENS"] == ref
    for w in workers:
        assert env_of(container(w, "worker"))["RHYMERL_WORKER_SCHEDULER_TOKEN"] == ref


def test_a_chart_made_worker_token_is_random_unless_given(render):
    def token():
        objects = render(set={"auth.enabled": True, "auth.tokens": ["t1"]})
        [secret] = [o for o in objects if o["kind"] == "Secret"]
        return secret["stringData"]["worker-token"]

    first, second = token(), token()
    assert len(first) >= 32 and first.isalnum() and first != second


def test_without_auth_nobody_gets_a_worker_token(default_objects):
    for name, var in (("scheduler", "RHYMERL_SCHEDULER_WORKER_TOKENS"), ("worker", "RHYMERL_WORKER_SCHEDULER_TOKEN")):
        assert var not in env_of(container(workload(default_objects, name), name))


def test_auth_without_tokens_fails_at_render(render):
    with pytest.raises(Exception, match="auth.existingSecret or at least one entry in auth.tokens"):
        render(set={"auth.enabled": True})


def test_vllm_profile_runs_the_vllm_image_with_the_vllm_engine(render, default_objects):
    """worker.engine reaches the worker as RHYMERL_WORKER_ENGINE; an unknown engine is refused."""
    c = container(workload(render(HERE / "values-vllm-cpu.yaml"), "worker"))
    assert env_of(c)["RHYMERL_WORKER_ENGINE"] == "vllm"
    assert env_of(c)["RHYMERL_WORKER_VLLM_KV_CACHE_GIB"] == "4"
    assert c["image"].startswith("rhymerl/worker-vllm:")
    assert env_of(container(workload(default_objects, "worker")))["RHYMERL_WORKER_ENGINE"] == "rhymerl"
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema_errors(deep_merge(defaults, yaml.safe_load((HERE / "values-vllm-cpu.yaml").read_text())), schema) == []
    assert schema_errors(deep_merge(defaults, {"worker": {"engine": "sglang"}}), schema)
