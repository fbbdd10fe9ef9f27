#!/usr/bin/env python3
"""rhymerl-healthcheck ADDRESS [SERVICE]: exit 0 if a gRPC server reports SERVING.

The images install this as /usr/local/bin/rhymerl-healthcheck for docker-compose
healthchecks and the chart's `helm test` pod (Kubernetes probes use the kubelet's
own grpc client). It asks the standard grpc.health.v1 service, as the probes do.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if not 2 <= len(argv) <= 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    address, service = argv[1], argv[2] if len(argv) == 3 else ""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as exc:
            print(f"{address} {service or '<server>'}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {service or '<server>'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
