"""The engine process's thread structure: the model steps on the main thread, gRPC I/O elsewhere.

torch's parallel CPU work runs 1.4-1.65x slower when started from a non-main thread, so this
pins where `tandem-engine` steps (services/engine/process.py): a later refactor that moves the
step back onto a side thread fails here, whatever machine it runs on.
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from services.cpu_priority import set_cpu_priority
from services.engine.process import serve_on_main_thread
from services.engine.server import EngineServer
from tests.services.conftest import WAIT_S, Stream


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs pytest's main thread")
def test_tandem_engine_steps_on_the_main_thread_and_stops_on_sigterm(engine_config):
    server = EngineServer(engine_config, "127.0.0.1:0")
    step_threads: list[threading.Thread] = []
    step = server.engine.step

    def recording_step():
        step_threads.append(threading.current_thread())
        return step()

    server.engine.step = recording_step
    served: dict[str, object] = {}

    def client(port: int) -> None:
        """One greedy request over the real Connect stream, then SIGTERM to this process."""
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = Stream(channel)
                stream.add("r", [7, 8, 9], temperature=0.0, max_tokens=4, ignore_eos=True)
                served["tokens"] = stream.wait_finished("r")["r"]
                served["io_threads"] = {t.name for t in threading.enumerate()}
                served["policies"] = {t.name: os.sched_getscheduler(t.native_id) for t in threading.enumerate()
                                      if t.name in ("engine-grpc-io", "MainThread")}
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

    try:
        serve_on_main_thread(server, grace=1.0, on_listening=start_client,  # returns after SIGTERM's drain
                             io_cpu_priority="idle")
        drivers[0].join(WAIT_S)
    finally:
        set_cpu_priority("normal")  # gRPC threads started from the I/O thread are idle: not for later tests

    assert "error" not in served, served.get("error")
    assert len(served["tokens"]) == 4
    assert step_threads and all(t is threading.main_thread() for t in step_threads)
    assert server.busy_loop.thread is threading.main_thread()
    assert "engine-grpc-io" in served["io_threads"] and "engine-busy-loop" not in served["io_threads"]
    # --io-cpu-priority reaches the I/O thread, never the stepping one (services/cpu_priority.py)
    assert served["policies"] == {"engine-grpc-io": os.SCHED_IDLE, "MainThread": os.SCHED_OTHER}
    assert not server.busy_loop.alive  # drained and stopped; the handler we replaced is back
    assert signal.getsignal(signal.SIGTERM) is previous


def test_serving_off_the_main_thread_is_refused(engine_config):
    server = EngineServer(engine_config, "127.0.0.1:0")
    errors = []
    worker = threading.Thread(target=lambda: _capture(errors, server))
    worker.start()
    worker.join(WAIT_S)
    assert errors and "main thread" in str(errors[0])


def _capture(errors: list, server: EngineServer) -> None:
    try:
        serve_on_main_thread(server, grace=0, on_listening=lambda port: None)
    except RuntimeError as exc:
        errors.append(exc)
