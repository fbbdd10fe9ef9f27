"""TLS on every gRPC port and bearer-token auth for trainers, over real sockets.

One self-signed certificate (made by openssl for the name the services verify) serves
history, scheduler and workers; the scheduler requires a token on RolloutService.
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
