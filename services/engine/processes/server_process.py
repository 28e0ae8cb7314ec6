"""`tandem-engine`'s server process: `python -m services.engine.processes.server_process FD CPUS <flags>`.

Started by the engine process (engine_process.py) with its end of the socket pair as file descriptor FD
and the CPUs to run on as CPUS ("1,2"; "-": all of the engine's); it reads the same flags as tandem-engine
(address, TLS, limits, --io-cpu-priority, logging) and serves `tandem.v1.EngineCoreService`, health and
reflection over the engine's busy loop through that socket (socket_pair.py's RemoteBusyLoop). It never
imports torch.

It stops when the engine process forwards SIGTERM / SIGINT (draining for --grace seconds), on a
SIGTERM of its own, or at once when the engine process is gone (the socket closes).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

from services.cpu_affinity import parse_cpus, run_on
from services.cpu_priority import lower_cpu_priority
from services.engine import convert
from services.engine.grpc_service import EngineGrpcServer
from services.engine.processes.socket_pair import RemoteBusyLoop
from services.security import flags as security_flags
from services.telemetry.request_log import configure_logging

logger = logging.getLogger("tandem.engine.io")


async def serve(sock: socket.socket, args) -> int:
    remote = RemoteBusyLoop(sock)
    info = convert.engine_info_from_bytes(await remote.connect())
    transport = security_flags.server_transport_from_args(args)
    server = EngineGrpcServer(remote, info, f"{args.host}:{args.port}", stall_timeout=args.stall_timeout,
                              max_pending_outputs=args.max_pending_outputs, transport=transport)
    try:
        port = await server.start()
    except Exception as exc:  # noqa: BLE001 - reported to the engine process, which exits with it
        remote.report_failure(str(exc))
        await server.stop(0)
        await remote.close_socket()
        return 1
    remote.report_listening(port)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, remote.request_shutdown, args.grace)
    await remote.shutdown_requested.wait()
    if not remote.engine_gone:
        logger.info("shutting down (grace %.1f s)", remote.shutdown_grace)
    await server.stop(remote.shutdown_grace)
    remote.stop()  # the engine's busy loop may end now
    await remote.close_socket()
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.engine.__main__ import build_parser  # torch-free: the flags only

    argv = sys.argv[1:] if argv is None else argv
    fd, cpus, args = int(argv[0]), parse_cpus(argv[1]), build_parser().parse_args(argv[2:])
    configure_logging(args.log_level, args.log_format)
    lower_cpu_priority(args.io_cpu_priority)  # before gRPC starts its threads: they inherit it
    run_on(cpus)  # off the CPU the engine steps on (--step-cpu), likewise before the threads
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the engine process too, which forwards it
    return asyncio.run(serve(socket.socket(fileno=fd), args))


if __name__ == "__main__":
    sys.exit(main())
