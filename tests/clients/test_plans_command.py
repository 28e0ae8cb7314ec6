"""`tandem plans` shows the plans the engine cached (written here by the engine's own writer,
kernels/cpu/linear_plan_cache.py) and `--clear` deletes them; each test has its own TANDEM_CACHE_DIR."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clients.cli import plans_command
from clients.cli.main import main
from kernels.cpu import linear_plan_cache
from kernels.cpu.linear_timing import NOISE_LIMIT, Race
from tests.clients.conftest import REPO, run_cli

PLAN = [(1, "int8_gemv"), (8, "int8_vnni"), (32, "linear_onednn")]
ENTRY = "linear 576x576 bias=False role=any torch.bfloat16 kernels=linear,int8_gemv,int8_vnni buckets=(1, 8, 32)"


@pytest.fixture(autouse=True)
def own_cache(private_cache):
    return private_cache  # tests/conftest.py: an empty folder of this test's own


def test_the_command_reads_the_file_the_engine_writes(private_cache):
    assert plans_command.plan_cache_path() == linear_plan_cache.cache_path()
    assert plans_command.plan_cache_path().parent == private_cache
    assert plans_command.MACHINE == linear_plan_cache.MACHINE
    assert f"over {NOISE_LIMIT * 100:.0f} % is not kept" in plans_command.__doc__


def test_show_lists_each_plan_with_when_and_how_noisy(capsys):
    linear_plan_cache.keep(ENTRY, PLAN, [Race({}, noise=0.042, contended=False, retakes=1, one_thread_takes=1)])
    linear_plan_cache.keep("dtype 576x1536 native_bf16=True", "bfloat16", [Race({}, noise=0.01, contended=False)])
    assert main(["plans"]) == 0
    out = capsys.readouterr().out
    record = json.loads(linear_plan_cache.cache_path().read_text())[linear_plan_cache.machine_key()][ENTRY]
    assert f"plan cache: {linear_plan_cache.cache_path()}" in out
    assert f"key {linear_plan_cache.machine_key()}: " in out and "threads" in out
    assert f"  {ENTRY}\n    1: int8_gemv, 8: int8_vnni, 32: linear_onednn  (measured {record['measured_at']}, " \
           "noise 4.2 %, 1 retakes, one-thread check fired in 1)" in out
    assert "  dtype 576x1536 native_bf16=True\n    bfloat16  (measured " in out


def test_a_noisy_plan_is_not_there_to_show(capsys):
    assert not linear_plan_cache.keep(ENTRY, PLAN, [Race({}, noise=NOISE_LIMIT * 2, contended=False, retakes=2)])
    assert main(["plans"]) == 0
    assert "no plan cache at" in capsys.readouterr().out


def test_entries_in_the_older_format_are_shown_as_unused(capsys):
    linear_plan_cache.cache_path().write_text(json.dumps({"0123456789abcdef": {ENTRY: [list(s) for s in PLAN]}}))
    assert main(["plans"]) == 0
    out = capsys.readouterr().out
    assert "key 0123456789abcdef: written before plans recorded their noise" in out
    assert "older format, noise unknown: not used; the next load times it again" in out


def test_a_broken_file_is_named_not_a_traceback(capsys):
    linear_plan_cache.cache_path().write_text("{not json")
    assert main(["plans"]) == 1
    assert f"the plan cache {linear_plan_cache.cache_path()} cannot be read" in capsys.readouterr().err


def test_clear_deletes_the_file_and_names_it(capsys):
    linear_plan_cache.keep(ENTRY, PLAN, [Race({}, noise=0.0, contended=False)])
    path = linear_plan_cache.cache_path()
    assert path.exists()
    assert main(["plans", "--clear"]) == 0
    assert f"deleted the plan cache {path}" in capsys.readouterr().out and not path.exists()
    assert main(["plans", "--clear"]) == 0
    assert f"no plan cache at {path}: nothing to clear" in capsys.readouterr().out


def test_json_prints_the_file(capsys):
    linear_plan_cache.keep(ENTRY, PLAN, [Race({}, noise=0.0, contended=False)])
    assert main(["plans", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(linear_plan_cache.cache_path().read_text())


def test_the_command_runs_without_torch(private_cache):
    """As the CLI's other client commands: a `pip install .` without the engine has `tandem plans`."""
    linear_plan_cache.keep(ENTRY, PLAN, [Race({}, noise=0.0, contended=False)])
    code = ("import sys; from clients.cli.main import main; code = main(['plans']); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels', 'engine_core')]; "
            "sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ENTRY in result.stdout
    assert run_cli("plans", "--clear").returncode == 0 and not linear_plan_cache.cache_path().exists()
