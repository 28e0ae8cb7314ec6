"""tandem-engine's structure: the model steps on the engine process's main thread, gRPC is served by a
process of its own (services/engine/processes/engine_process.py, services/engine/processes/socket_pair.py).

torch's parallel CPU work runs 1.4-1.65x slower when started from a non-main thread, and a gRPC
server on a thread of the engine's own process took the GIL from the stepping thread on every
output; so this pins both: a later refactor that moves the step back onto a side thread, or the
gRPC server back into the engine's process, fails here, whatever machine it runs on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from clients.local_stack import free_port
from services.engine.processes.engine_process import serve_on_main_thread
from services.engine.server import EngineServer
from tests.services.conftest import WAIT_S, Stream

SERVER_ARGV = ["--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"]


def _children() -> list[int]:
    """This process's child processes (started from its main thread)."""
    return [int(pid) for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()]


def _thread_cpus(pid: int, but: int | None = None) -> dict[int, set[int]]:
    """The CPUs each thread of process `pid` may run on (but thread `but`)."""
    cpus = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        if tid != but:
            with contextlib.suppress(ProcessLookupError):
                cpus[tid] = os.sched_getaffinity(tid)
    return cpus


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs pytest's main thread")
def test_tandem_engine_steps_on_the_main_thread_serves_from_its_own_process_and_stops_on_sigterm(engine_config):
    server = EngineServer(engine_config, "127.0.0.1:0")
    step_threads: list[threading.Thread] = []
    step_cpus: list[set[int]] = []  # the stepping thread's CPUs, each step
    others_cpus: dict[int, set[int]] = {}  # the other threads' CPUs, at the first step
    step = server.engine.step

    def recording_step():
        step_threads.append(threading.current_thread())
        step_cpus.append(os.sched_getaffinity(0))
        if not others_cpus:
            others_cpus.update(_thread_cpus(os.getpid(), but=threading.get_native_id()))
        return step()

    server.engine.step = recording_step
    served: dict[str, object] = {}

    def client(port: int) -> None:
        """One greedy request over the real Connect stream, then SIGTERM to this process."""
        try:
            servers = [pid for pid in _children() if "services.engine.processes.server_process" in _cmdline(pid)]
            served["server_pids"] = servers
            served["policies"] = {pid: os.sched_getscheduler(pid) for pid in servers}
            served["server_cpus"] = {cpus for pid in servers for cpus in map(frozenset, _thread_cpus(pid).values())}
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = Stream(channel)
                stream.add("r", [7, 8, 9], temperature=0.0, max_tokens=4, ignore_eos=True)
                served["tokens"] = stream.wait_finished("r")["r"]
                stream.close()
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            served["error"] = exc
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the path `kill` and Kubernetes take

    previous = signal.getsignal(signal.SIGTERM)
    drivers: list[threading.Thread] = []

    def start_client(port: int) -> None:
        drivers.append(threading.Thread(target=client, args=(port,), name="test-client", daemon=True))
        drivers[0].start()

    status = serve_on_main_thread(server, [*SERVER_ARGV, "--io-cpu-priority", "idle"], on_listening=start_client,
                                  grace=1.0)  # returns after SIGTERM's drain
    drivers[0].join(WAIT_S)

    assert "error" not in served, served.get("error")
    assert status == 0
    assert len(served["tokens"]) == 4
    assert step_threads and all(t is threading.main_thread() for t in step_threads)
    assert server.busy_loop.thread is threading.main_thread()
    # gRPC is served by one child process, which --io-cpu-priority reaches; this process keeps its priority
    assert len(served["server_pids"]) == 1
    assert served["policies"] == {served["server_pids"][0]: os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert not any(pid in _children() for pid in served["server_pids"])  # it exited and was reaped
    # --step-cpu auto: the step keeps to one CPU, every thread of the server process to the others; the
    # engine's other threads (OpenMP workers among them) keep all, and so does this thread afterwards
    allowed = os.sched_getaffinity(0)
    if len(allowed) > 1:
        assert len(step_cpus[0]) == 1 and all(cpus == step_cpus[0] for cpus in step_cpus)
        assert served["server_cpus"] == {frozenset(allowed - step_cpus[0])}
    else:  # one CPU: nothing to keep apart, nothing pinned
        assert step_cpus[0] == allowed and served["server_cpus"] == {frozenset(allowed)}
    assert others_cpus and all(cpus == allowed for cpus in others_cpus.values())
    assert not server.busy_loop.alive  # drained and stopped; the handler we replaced is back
    # its socket end's threads were joined: left to the interpreter's exit, one freed the engine's tensors there
    assert not [t for t in threading.enumerate() if t.name.startswith("engine-socket")]
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs pytest's main thread")
def test_an_address_the_server_process_cannot_bind_fails_the_start_and_leaves_no_process(engine_config):
    server = EngineServer(engine_config, "127.0.0.1:0")
    with pytest.raises(RuntimeError, match="bind|listen"):
        serve_on_main_thread(server, ["--host", "203.0.113.1", "--port", "1", "--log-level", "ERROR"],
                             on_listening=lambda port: pytest.fail("it cannot listen"), grace=0)
    assert not [pid for pid in _children() if "services.engine.processes.server_process" in _cmdline(pid)]


def test_serving_off_the_main_thread_is_refused(engine_config):
    server = EngineServer(engine_config, "127.0.0.1:0")
    errors = []
    worker = threading.Thread(target=lambda: _capture(errors, server))
    worker.start()
    worker.join(WAIT_S)
    assert errors and "main thread" in str(errors[0])


def _capture(errors: list, server: EngineServer) -> None:
    try:
        serve_on_main_thread(server, SERVER_ARGV, on_listening=lambda port: None, grace=0)
    except RuntimeError as exc:
        errors.append(exc)


# ---- either process dies: the other follows ------------------------------------------------------
def _start_tandem_engine(model_dir) -> tuple[subprocess.Popen, int]:
    """tandem-engine on a tiny model (loopback, an OS-picked port); (process, its gRPC server process's pid)."""
    engine = subprocess.Popen(
        [sys.executable, "-m", "services.engine", "--model", str(model_dir), "--dtype", "float32",
         "--num-blocks", "64", "--host", "127.0.0.1", "--port", str(free_port()), "--log-level", "ERROR"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in engine.stdout.readline()
        children = Path(f"/proc/{engine.pid}/task/{engine.pid}/children").read_text().split()
        assert len(children) == 1 and "services.engine.processes.server_process" in _cmdline(int(children[0]))
    except BaseException:
        engine.kill()
        engine.wait()
        raise
    return engine, int(children[0])


def _exits_within(pid: int, seconds: float) -> bool:
    """The process is gone (or a zombie whose parent died, soon reaped by init) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_engine_process_takes_its_grpc_server_process_with_it(tiny_model_dir):
    engine, server_pid = _start_tandem_engine(tiny_model_dir)
    try:
        engine.kill()  # SIGKILL: no handler runs; the socket pair closes with the process
        engine.wait()
        assert _exits_within(server_pid, WAIT_S), "the gRPC server process outlived its engine"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)


def test_a_killed_grpc_server_process_stops_the_engine_with_a_failure_status(tiny_model_dir):
    engine, server_pid = _start_tandem_engine(tiny_model_dir)
    try:
        os.kill(server_pid, signal.SIGKILL)
        assert engine.wait(WAIT_S) != 0  # nothing can reach it any more: it ends, and says it failed
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
