"""Container healthcheck: one grpc.health.v1 Check; exit 0 when the server says SERVING, else 1.

    python docker/healthcheck.py                      # the port this container's server was started with
    python docker/healthcheck.py 127.0.0.1:50061
    python docker/healthcheck.py --service tandem.v1.EngineCoreService --tls-ca ca.crt \
        --tls-cert tls.crt --tls-key tls.key --tls-server-name tandem-engine 127.0.0.1:50061
    python docker/healthcheck.py --service tandem.v1.AdminService 127.0.0.1:50051

The frontend's "" and tandem.v1.GenerationService are its readiness (NOT_SERVING while it drains or its
engines are paused or asleep); tandem.v1.AdminService stays SERVING until shutdown, so a check that may get
the container replaced asks for it.

Plaintext by default (the compose healthchecks). With --tls-ca it speaks TLS, and with
--tls-cert/--tls-key it presents a client certificate (a server with --tls-client-ca wants one):
Kubernetes' own gRPC probes are plaintext only, so deploy/k8s/components/tls probes with this.

Without an address it probes 127.0.0.1 at the `--port` of the tandem-engine or tandem-frontend process running
in the container (its default port when the flag is absent), so an image's HEALTHCHECK follows a port changed
on the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.splitlines()[0])
    parser.add_argument("address", metavar="HOST:PORT", nargs="?",
                        help="default: 127.0.0.1 and the --port of this container's tandem server")
    parser.add_argument("--service", default="", help="the health service name to check (default: the server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    parser.add_argument("--tls-ca", metavar="PEM", help="speak TLS, trusting this CA")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--tls-server-name", metavar="NAME", help="the name the server's certificate carries")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if (args.tls_cert or args.tls_server_name) and not args.tls_ca:
        parser.error("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
    if args.address is None:
        port = server_port(running_commands())
        if port is None:
            parser.error("no tandem-engine or tandem-frontend process found here: give HOST:PORT")
        args.address = f"127.0.0.1:{port}"
    return args


DEFAULT_PORTS = {"tandem-engine": 50061, "tandem-frontend": 50051}


def running_commands(proc: Path = Path("/proc")) -> list[list[str]]:
    """The argv of every process this user can see (in a container: the server and this script)."""
    commands = []
    for entry in proc.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:  # the process ended meanwhile
                continue
            if raw:
                commands.append(raw.decode(errors="replace").rstrip("\0").split("\0"))
    return commands


def server_port(commands: list[list[str]]) -> int | None:
    """The --port of the first tandem server among `commands` (its default when absent), or None."""
    for argv in commands:
        # a console script runs as `python /opt/tandem/bin/tandem-engine ...`: look at the first two words
        name = next((Path(word).name for word in argv[:2] if Path(word).name in DEFAULT_PORTS), None)
        if name is None:
            continue
        flags = argparse.ArgumentParser(add_help=False)
        flags.add_argument("--port", type=int, default=DEFAULT_PORTS[name])
        return flags.parse_known_args(argv[1:])[0].port
    return None


def channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(_read(args.tls_ca), _read(args.tls_key), _read(args.tls_cert))
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        with channel(args) as chan:
            reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                          timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:  # a certificate or key file that cannot be read
        print(f"{args.address}: {exc}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
