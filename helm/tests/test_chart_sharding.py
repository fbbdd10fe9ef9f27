"""The chart's scale-out layout (sharding.enabled): N scheduler shards, each with its own
workers, behind one step router that trainers call; the shards announce themselves in
the release's Redis, which the router reads. Rendered by Helm's own engine and validated
against the Kubernetes API types, as test_chart.py does for the one-scheduler layout."""

from __future__ import annotations

import pytest
from chart_render import MONITORING_API, RenderError
from test_chart import GPU_VALUES, by_kind, component, container, env_of

from services.router.settings import RouterSettings
from services.scheduler.settings import SchedulerSettings

SHARDED = {"sharding.enabled": True, "sharding.shards": 3}


@pytest.fixture(scope="module")
def sharded(render):
    return render(set=SHARDED)


@pytest.fixture(scope="module")
def sharded_gpu(render):
    return render(GPU_VALUES, set=SHARDED, api_versions=[MONITORING_API])


def deployments(objects, name: str) -> list[dict]:
    return sorted((o for o in by_kind(objects, "Deployment").values() if component(o) == name),
                  key=lambda o: o["metadata"]["name"])


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("profile", ["default", "production"])
def test_sharded_objects_are_valid_and_distinct(profile, sharded, sharded_gpu, validate):
    objects = sharded if profile == "default" else sharded_gpu
    for obj in objects:
        if obj["apiVersion"] != MONITORING_API:
            validate(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))
    assert len(deployments(objects, "scheduler")) == len(deployments(objects, "worker")) == 3
    assert len(deployments(objects, "router")) == 1


@pytest.mark.parametrize("profile", ["default", "production"])
def test_each_shards_workers_register_with_their_own_scheduler(profile, sharded, sharded_gpu):
    """A worker's scheduler address is its shard's Service, which selects that shard's
    scheduler pod and no other; every Deployment's selector picks only its own pods."""
    objects = sharded if profile == "default" else sharded_gpu
    services = by_kind(objects, "Service")
    schedulers = deployments(objects, "scheduler")
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in by_kind(objects, "Deployment").values()]
    for d in by_kind(objects, "Deployment").values():
        assert sum(selects(d["spec"]["selector"]["matchLabels"], p) for p in pods) == 1, d["metadata"]["name"]
    for worker in deployments(objects, "worker"):
        address = env_of(container(worker, "worker"))["RHYMERL_WORKER_SCHEDULER_ADDRESS"]
        host, port = address.rsplit(":", 1)
        service = services[host]
        [target] = [s for s in schedulers
                    if selects(service["spec"]["selector"], s["spec"]["template"]["metadata"]["labels"])]
        shard = worker["spec"]["template"]["metadata"]["labels"]["rhymerl.io/shard"]
        assert target["spec"]["template"]["metadata"]["labels"]["rhymerl.io/shard"] == shard
        assert int(port) == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")


@pytest.mark.parametrize("profile", ["default", "production"])
def test_shards_announce_where_the_router_reads(profile, sharded, sharded_gpu):
    objects = sharded if profile == "default" else sharded_gpu
    router = env_of(container(deployments(objects, "router")[0], "router"))
    shard_envs = [env_of(container(s, "scheduler")) for s in deployments(objects, "scheduler")]
    assert all(e["RHYMERL_SCHEDULER_SHARD_REGISTRY_URL"] == router["RHYMERL_ROUTER_REGISTRY_URL"] for e in shard_envs)
    assert len({e["RHYMERL_SCHEDULER_SHARD_ID"] for e in shard_envs}) == 3
    services = by_kind(objects, "Service")
    for env, sched in zip(shard_envs, deployments(objects, "scheduler")):
        host, port = env["RHYMERL_SCHEDULER_SHARD_ADDRESS"].rsplit(":", 1)  # what the router dials
        assert selects(services[host]["spec"]["selector"], sched["spec"]["template"]["metadata"]["labels"])
        assert port == env["RHYMERL_SCHEDULER_PORT"]
    # every RHYMERL_* name is a setting (pydantic-settings ignores a misspelt one)
    for env, cls in [(router, RouterSettings), *[(e, SchedulerSettings) for e in shard_envs]]:
        prefix = cls.model_config["env_prefix"]
        names = {n for n in env if n.startswith(prefix)}
        assert names <= {prefix + f.upper() for f in cls.model_fields}, names


def test_trainers_reach_the_router_and_only_it_reaches_the_shards(sharded_gpu):
    objects = sharded_gpu
    policies = {component(p): p for p in by_kind(objects, "NetworkPolicy").values()}
    def grpc_peers(policy):
        return [p for rule in policy["spec"]["ingress"] if {"port": "grpc"} in rule["ports"]
                for p in rule.get("from", [])]

    peers = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in grpc_peers(policies["scheduler"])]
    assert sorted(peers) == ["router", "worker"]
    router_peers = grpc_peers(policies["router"])
    assert router_peers and any("podSelector" not in p or "namespaceSelector" in p for p in router_peers)
    # trainers' tokens are checked by the router; the shards take calls from it and their workers
    router = env_of(container(deployments(objects, "router")[0], "router"))
    assert router["RHYMERL_ROUTER_AUTH_TOKENS"] == {"secretKeyRef": {"name": "rhymerl-trainer-tokens", "key": "tokens"}}
    for sched in deployments(objects, "scheduler"):
        assert "RHYMERL_SCHEDULER_AUTH_TOKENS" not in env_of(container(sched, "scheduler"))
        # ...but a shard's RegistryService asks the workers' token all the same
        assert env_of(container(sched, "scheduler"))["RHYMERL_SCHEDULER_WORKER_TOKENS"] == {
            "secretKeyRef": {"name": "rhymerl-trainer-tokens", "key": "worker-token"}}
    [test_pod] = [o for o in objects if o["kind"] == "Pod"]
    # the GPU profile has TLS: `helm test` asks the router's plaintext health port
    assert test_pod["spec"]["containers"][0]["command"][1] == "rhymerl-router:8086"


def test_sharding_needs_a_shared_redis_and_leaves_the_default_layout_alone(render):
    default_objects = render()
    with pytest.raises(RenderError, match="sharding needs a Redis"):
        render(set={**SHARDED, "redis.enabled": False, "history.redisUrl": ""})
    assert not deployments(default_objects, "router")
    assert [d["metadata"]["name"] for d in deployments(default_objects, "scheduler")] == ["rhymerl-scheduler"]
    assert "rhymerl.io/shard" not in deployments(default_objects, "worker")[0]["spec"]["selector"]["matchLabels"]


def test_the_router_serves_metrics_on_its_own_default_port(sharded):
    """The chart's router.metricsPort is the router's default (RHYMERL_ROUTER_METRICS_PORT),
    and its container and Service expose it as `metrics` (what the PodMonitor scrapes)."""
    [router] = deployments(sharded, "router")
    default = RouterSettings.model_fields["metrics_port"].default
    assert default != 9090  # Prometheus's own port
    c = container(router, "router")
    assert env_of(c)["RHYMERL_ROUTER_METRICS_PORT"] == str(default)
    assert {"name": "metrics", "containerPort": default} in c["ports"]
    [service] = [s for s in by_kind(sharded, "Service").values() if component(s) == "router"]
    assert any(p["name"] == "metrics" and p["port"] == default for p in service["spec"]["ports"])


def test_prometheus_scrapes_the_router_too(render):
    monitor = next(o for o in render(set={**SHARDED, "metrics.podMonitor.enabled": True}) if o["kind"] == "PodMonitor")
    assert "router" in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
