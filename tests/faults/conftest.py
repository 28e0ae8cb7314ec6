"""Fault-suite fixtures: a shared engine + frontend as processes, the scale, and the session's FaultReport.

`make test-faults` runs the quick version (CI runs it); `make test-faults-long` (TANDEM_FAULTS=long) the long one,
which also writes bench_results/faults.json. Every process is stopped by its fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.loader import default_model_path
from tests.engine_core.tiny_models import write_tiny_model
from tests.faults.probes import MAX_MODEL_LEN, VOCAB, leaked_blocks, settle
from tests.faults.processes import FaultStack
from tests.faults.report import FaultReport
from tests.faults.scale import SCALE

REPORT = FaultReport(SCALE.name)
RESULTS = Path(__file__).resolve().parents[2] / "bench_results" / "faults.json"

# The shared engine: small enough for CPU, 16 running sequences, bounded per-connection output buffer.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
                "--num-blocks", "400", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                "--max-pending-outputs", "64"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/faults/" in item.nodeid:
            item.add_marker(pytest.mark.faults)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if REPORT.requests:
        terminalreporter.section(f"fault suite ({SCALE.name})")
        terminalreporter.write_line(REPORT.table())
        if SCALE.name == "long":
            REPORT.write(RESULTS)
            terminalreporter.write_line(f"  written to {RESULTS}")


@pytest.fixture(scope="session")
def scale():
    return SCALE


@pytest.fixture(scope="session")
def report() -> FaultReport:
    return REPORT


@pytest.fixture(scope="session")
def fault_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("faults-model"), vocab_size=VOCAB, max_position_embeddings=512)


@pytest.fixture(scope="session")
def make_fault_stack(fault_model_dir):
    """make() -> a new FaultStack (engine only; add frontends); every stack stopped at the end."""
    stacks: list[FaultStack] = []

    def make(*extra_engine_flags: str) -> FaultStack:
        stacks.append(FaultStack(["--model", str(fault_model_dir), *ENGINE_FLAGS, *extra_engine_flags],
                                 str(default_model_path())))
        return stacks[-1]

    yield make
    for stack in stacks:
        stack.stop()
        for service in stack.services():
            REPORT.rss(service.name, service.peak_rss_mib)


@pytest.fixture(scope="session")
def stack(make_fault_stack) -> FaultStack:
    """The shared stack: one engine and one frontend; tests leave it idle, resumed and awake."""
    s = make_fault_stack()
    s.add_frontend()
    return s


@pytest.fixture
def idle_after(stack, report):
    """Checks after the test that the shared engine settled: idle, every KV block free (leaks are counted)."""
    yield stack
    stats = settle(stack.engine.address)
    report.blocks_leaked += leaked_blocks(stats)
    assert leaked_blocks(stats) == 0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
