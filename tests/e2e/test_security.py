"""TLS on every gRPC port and bearer-token auth for trainers and workers, over real sockets.

One self-signed certificate (made by openssl for the name the services verify) serves
history, scheduler and workers; the scheduler requires a token on RolloutService, and
one on RegistryService, which the workers present (RHYMERL_WORKER_SCHEDULER_TOKEN).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams

from tests.e2e.cluster import Cluster, save_tiny_model

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

TOKEN = "s3cret-token"
NAME = "rhymerl.internal"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, seed=3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt"), "-subj", f"/CN={NAME}",
                    "-addext", f"subjectAltName=DNS:{NAME}"], check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, certs):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    tls = dict(tls_cert_file=str(certs / "tls.crt"), tls_key_file=str(certs / "tls.key"),
               tls_ca_file=str(certs / "tls.crt"), tls_server_name=NAME)
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=1, tls=tls,
                auth_tokens=f"other-token,{TOKEN}").start()
    yield c
    c.stop()


def client(cluster, certs, **kw) -> RolloutClient:
    kw.setdefault("root_certificates", (certs / "tls.crt").read_bytes())
    return RolloutClient(cluster.address, timeout_s=60, max_retries=0, server_name=NAME, **kw)


def stored_prompts(cluster, prompt_ids) -> dict:
    from services.history.client import HistoryClient

    async def read():
        async with HistoryClient(cluster.history_address, tls=cluster.scheduler.core.link.tls) as h:
            return await h.get_history(prompt_ids, include_tokens=False)
    return asyncio.run(read())


def test_a_trainer_with_a_valid_token_over_tls_gets_its_step(cluster, certs):
    with client(cluster, certs, token=TOKEN) as c:
        result = c.rollout("secure", [Prompt("s0", [3, 4, 5])], n=2, sampling=GREEDY)
    assert sorted(s.key for s in result.samples) == [("s0", 0), ("s0", 1)]
    # the scheduler wrote the samples to history over TLS, and read them back
    assert [e.lengths.size for e in stored_prompts(cluster, ["s0"])["s0"]] == [2]


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
def test_no_or_a_wrong_token_is_unauthenticated_and_leaves_no_trace(cluster, certs, token):
    with client(cluster, certs, token=token) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.rollout(f"intruder-{token}", [Prompt("intruder", [3, 4, 5])], n=2, sampling=GREEDY)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in err.value.details()
        for call in (c.stats, lambda: c.cancel_step("secure"), lambda: c.push_weights(9, b"x" * 10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"intruder-{token}" not in cluster.scheduler.core.steps
    assert stored_prompts(cluster, ["intruder"])["intruder"] == []


def test_plaintext_clients_cannot_talk_to_a_tls_port(cluster, certs):
    with RolloutClient(cluster.address, timeout_s=5, max_retries=0, token=TOKEN) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.stats()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_checks_need_no_token(cluster, certs):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials = grpc.ssl_channel_credentials((certs / "tls.crt").read_bytes())
    with grpc.secure_channel(cluster.address, credentials,
                             options=[("grpc.ssl_target_name_override", NAME)]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_with_tls_a_plaintext_port_serves_health_only(certs):
    """Kubernetes gRPC probes cannot speak TLS: the health service (and nothing else)
    is also served in plaintext on health_port, and follows the server's status."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc

    from services.common.grpc_server import Server
    from services.common.redis_server import free_port
    from services.common.security import TLSConfig

    async def main():
        server = Server([], ["rhymerl.v1.RolloutService"], tls=TLSConfig(str(certs / "tls.crt"), str(certs / "tls.key")),
                        health_port=free_port())
        await server.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
                check = health_pb2_grpc.HealthStub(ch).Check
                request = health_pb2.HealthCheckRequest(service="rhymerl.v1.RolloutService")
                assert (await check(request, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
                await server.set_serving(False)
                assert (await check(request, timeout=5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.RpcError) as err:
                    await rollout_pb2_grpc.RolloutServiceStub(ch).GetStats(rollout_pb2.GetStatsRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(0)
    asyncio.run(main())


def registry(cluster, certs, token=None):
    """A RegistryService stub over TLS, and the metadata presenting ``token``."""
    credentials = grpc.ssl_channel_credentials((certs / "tls.crt").read_bytes())
    ch = grpc.secure_channel(cluster.address, credentials, options=[("grpc.ssl_target_name_override", NAME)])
    from rhymerl.v1 import worker_pb2_grpc

    return ch, worker_pb2_grpc.RegistryServiceStub(ch), (("authorization", f"Bearer {token}"),) if token else ()


@pytest.mark.parametrize("token", [None, "wrong"])
def test_without_a_token_nobody_registers_or_deregisters_a_worker(cluster, certs, token):
    """RegistryService shares the scheduler's port: with tokens set, an anonymous caller
    could otherwise deregister the real workers (every step UNAVAILABLE) or register
    fake ones (and be sent the prompts)."""
    from rhymerl.v1 import worker_pb2

    fake = worker_pb2.RegisterRequest(worker_id="intruder", address="127.0.0.1:1", max_num_seqs=8,
                                      vocab_size=96, max_model_len=512)
    ch, stub, metadata = registry(cluster, certs, token)
    with ch:
        calls = [lambda: stub.Register(fake, timeout=10, metadata=metadata),
                 lambda: stub.Deregister(worker_pb2.DeregisterRequest(worker_id="w0"), timeout=10, metadata=metadata),
                 lambda: list(stub.Heartbeat(iter([fake]), timeout=10, metadata=metadata))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "RegistryService" in err.value.details() and "bearer token" in err.value.details()
    workers = cluster.scheduler.core.workers.workers
    assert "intruder" not in workers
    assert workers["w0"].can_take_work
    with client(cluster, certs, token=TOKEN) as c:
        result = c.rollout(f"after-intruder-{token}", [Prompt("s1", [3, 4, 5])], n=1, sampling=GREEDY)
    assert len(result.samples) == 1


def test_a_worker_with_the_token_registers_over_tls(cluster, certs):
    """The cluster's worker presented its token (RHYMERL_WORKER_SCHEDULER_TOKEN) on its
    heartbeat stream; a caller with that token registers as well, and leaves."""
    from rhymerl.v1 import worker_pb2

    assert cluster.workers["w0"][0].registration is not None and not cluster.workers["w0"][0].registration.done()
    assert "w0" in cluster.scheduler.core.workers.workers
    ch, stub, metadata = registry(cluster, certs, cluster.worker_token)
    with ch:
        stub.Register(worker_pb2.RegisterRequest(worker_id="extra", address="127.0.0.1:9", max_num_seqs=1,
                                                 vocab_size=96, max_model_len=512, draining=False),
                      timeout=10, metadata=metadata)
        assert "extra" in cluster.scheduler.core.workers.workers
        stub.Deregister(worker_pb2.DeregisterRequest(worker_id="extra"), timeout=10, metadata=metadata)
    assert "extra" not in cluster.scheduler.core.workers.workers


def test_worker_tokens_and_trainer_tokens_open_only_their_own_service():
    """RHYMERL_SCHEDULER_WORKER_TOKENS guard RegistryService, AUTH_TOKENS RolloutService:
    a trainer's token registers no worker, a worker's token submits no step."""
    from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc, worker_pb2, worker_pb2_grpc

    from services.scheduler.server import start_scheduler
    from services.scheduler.settings import SchedulerSettings

    def bearer(token):
        return (("authorization", f"Bearer {token}"),)

    request = worker_pb2.RegisterRequest(worker_id="w", address="127.0.0.1:9", max_num_seqs=1, vocab_size=96,
                                         max_model_len=512)

    async def main():
        _, port, stop = await start_scheduler(SchedulerSettings(
            host="127.0.0.1", port=0, metrics_port=0, health_port=0, history_address="",
            auth_tokens="trainer", worker_tokens="worker-a, worker-b"))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                reg, roll = worker_pb2_grpc.RegistryServiceStub(ch), rollout_pb2_grpc.RolloutServiceStub(ch)
                for metadata in ((), bearer("trainer")):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await reg.Register(request, timeout=10, metadata=metadata)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await roll.GetStats(rollout_pb2.GetStatsRequest(), timeout=10, metadata=bearer("worker-a"))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await reg.Register(request, timeout=10, metadata=bearer("worker-b"))
                stats = await roll.GetStats(rollout_pb2.GetStatsRequest(), timeout=10, metadata=bearer("trainer"))
                assert [w.worker_id for w in stats.workers] == ["w"]
        finally:
            await stop()
    asyncio.run(asyncio.wait_for(main(), 60))

