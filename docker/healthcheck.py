"""Container healthcheck: one grpc.health.v1 Check; exit 0 when the server says SERVING, else 1.

    python docker/healthcheck.py 127.0.0.1:50061
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: healthcheck.py HOST:PORT", file=sys.stderr)
        return 2
    with grpc.insecure_channel(argv[0]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3.0)
        except grpc.RpcError as exc:
            print(f"{argv[0]}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{argv[0]}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
