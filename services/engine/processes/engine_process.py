"""tandem-engine's engine process: the model steps on its main thread, and it starts the server process,
which serves gRPC.

torch's OpenMP work started from a thread other than the main one runs slower (ATen's parallel
elementwise ops; docs/cpu-tuning.md#two-processes-per-engine, scripts/bench_engine.py), so the busy
loop steps on the main thread, as vLLM's EngineCoreProc's does. The gRPC server (grpc.aio, its
health watchdog) does not share that process: on a thread beside the step it took the GIL on every
output, and the step waited for it on every token.
`serve_on_main_thread` starts it as a child (server_process.py, torch-free) joined by a socket pair
(socket_pair.py), at the CPU priority of --io-cpu-priority
(services/cpu_priority.py), and on the CPUs besides the one the stepping thread keeps to (--step-cpu,
services/cpu_affinity.py). /metrics and the request spans stay with the engine, which records
them. Both `tandem-engine` and `tandem serve` (which starts `tandem-engine` processes) run
through it; the in-process transport (InProcessEngineClient) and `make bench` step on the main
thread as well, with the frontend on a thread beside it (`run_beside_engine`).

Shutdown: SIGTERM / SIGINT reach the engine process's main thread (Python runs signal handlers
only there, between bytecodes, so at the latest after the step in progress), which forwards
them to the server process; it drains (`EngineGrpcServer.stop`), lets the busy loop end and
exits; `run()` returns on the main thread, which then reaps it. If the busy loop crashes, the
server stays up answering NOT_SERVING / UNAVAILABLE until it is told to stop. If either process
dies the other follows: the server process ends its streams UNAVAILABLE when the socket closes,
and the engine stops when the server process is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Awaitable, Callable, TypeVar

from services.cpu_affinity import choose_step_cpu, cpus_besides, format_cpus, pinned, run_on
from services.cpu_priority import lower_cpu_priority
from services.engine.processes.socket_pair import EngineEnd, socket_pair
from services.engine.server import EngineServer

logger = logging.getLogger(__name__)
T = TypeVar("T")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_CHILD_EXIT_S = 10.0  # how long the gRPC server process gets to exit once told to


def serve_on_main_thread(server: EngineServer, server_argv: list[str], on_listening: Callable[[int], None],
                         grace: float, step_cpu: str = "auto") -> int:
    """Serve until SIGTERM / SIGINT, stepping `server`'s engine on this thread (which must be the main one)
    and serving gRPC from a process of its own, started with `server_argv` (tandem-engine's flags: it reads
    the address, TLS, limits, --io-cpu-priority and logging from them). `step_cpu` (--step-cpu): the CPU
    this thread keeps to, the server process running on the others (services/cpu_affinity.py).

    `on_listening(port)` is called once the gRPC server listens. Raises RuntimeError with the server
    process's reason if it could not start (e.g. the address is taken). Returns after a graceful drain
    (`grace` seconds for the requests in flight): the server process's exit status, non-zero when it
    ended on its own (then the engine stops too).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("serve_on_main_thread must run on the main thread: the engine steps there")
    cpu = choose_step_cpu(step_cpu)
    io_cpus = cpus_besides(cpu)
    engine_sock, server_sock = socket_pair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path or os.getcwd() for path in sys.path)}
    child = subprocess.Popen([sys.executable, "-m", "services.engine.processes.server_process",
                              str(server_sock.fileno()), format_cpus(io_cpus), *server_argv],
                             pass_fds=(server_sock.fileno(),), env=env)
    server_sock.close()
    engine_end = EngineEnd(server.busy_loop, engine_sock)
    previous = {signum: signal.signal(signum, lambda *_: engine_end.request_shutdown(grace))
                for signum in _STOP_SIGNALS}
    try:
        engine_end.start(server.info_proto().SerializeToString())
        port = engine_end.wait_listening()
        server.start_metrics()
        on_listening(port)
        with pinned(cpu):  # after the socket end's threads started: they keep every CPU
            server.busy_loop.run()  # until the server process lets it end (after its drain), or it crashes
        return child.wait()  # after a crash it still answers NOT_SERVING / UNAVAILABLE until told to stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.poll() is None:
            engine_end.request_shutdown(0)
            try:
                child.wait(_CHILD_EXIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        engine_end.close()
        server.stop_metrics()
        server.busy_loop.stop(timeout=0)


def run_beside_engine(busy_loop, main: Callable[[], Awaitable[T]], io_cpu_priority: str = "normal",
                      step_cpu: str = "auto") -> T:
    """Run `main()` on an asyncio loop in a background thread while this (the main) thread steps the engine.

    The in-process transport's counterpart of `serve_on_main_thread`: a frontend (AsyncLLM over
    InProcessEngineClient) and whatever drives it run on the background loop, the busy loop runs here
    until `main()` returns (or raises), then stops. The background thread runs at `io_cpu_priority`, and
    this thread keeps to `step_cpu` while the background one keeps off it, as in `serve_on_main_thread`
    (the pin ends with the busy loop). It shares this process's GIL with the step (a thread,
    not a process: the transport hands Python objects across). Returns what `main()` returned; re-raises
    what it raised.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_beside_engine must run on the main thread: the engine steps there")
    outcome: dict[str, object] = {}
    cpu = choose_step_cpu(step_cpu)

    def io() -> None:
        lower_cpu_priority(io_cpu_priority, whole_process=False)
        run_on(cpus_besides(cpu), whole_process=False)
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread below
            outcome["error"] = exc
        finally:
            busy_loop.stop(timeout=0)  # ends run() below; it is not ours to wait for

    thread = threading.Thread(target=io, name="in-process-io", daemon=True)
    thread.start()
    with pinned(cpu):
        busy_loop.run()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
