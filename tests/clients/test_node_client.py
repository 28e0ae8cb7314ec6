"""The Node.js client (clients/node, protos loaded at run time) streams the same greedy chat answer
as the Python client. `make install` runs `npm ci` there; without npm this test cannot run."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from clients.client import TandemClient
from tests.clients.conftest import REPO

NODE_DIR = REPO / "clients" / "node"


@pytest.fixture(scope="module")
def node():
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node has no node_modules: run `make install` (it runs `npm ci` there)")
    return node


def node_chat(node: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([node, str(NODE_DIR / "chat.js"), *args], capture_output=True, text=True, timeout=120)


def test_node_streams_the_same_answer_as_the_python_client(node, live_stack):
    message, system = "Write one sentence about rivers.", "You are a poet."
    with TandemClient(live_stack.frontend_address, timeout=60) as client:
        chunks = list(client.chat([{"role": "system", "content": system}, {"role": "user", "content": message}],
                                  temperature=0, max_tokens=24, ignore_eos=True))
    expected = "".join(c.text for c in chunks)
    assert len(chunks) > 2 and expected
    result = node_chat(node, "--address", live_stack.frontend_address, "--system", system, "--temperature", "0",
                       "--max-tokens", "24", "--ignore-eos", message)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_node_prints_the_status_of_a_bad_request(node, live_stack):
    result = node_chat(node, "--address", live_stack.frontend_address, "--temperature", "-1", "hi")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("tandem-node: INVALID_ARGUMENT: sampling_params.temperature")


def test_node_asks_for_a_lora_adapter(node, live_stack):
    """--lora sends lora_name: the live stack's engine serves no adapters, so the answer is NOT_FOUND."""
    result = node_chat(node, "--address", live_stack.frontend_address, "--lora", "sql", "hi")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("tandem-node: NOT_FOUND:") and "'sql'" in result.stderr, result.stderr


def test_node_names_an_unreadable_file_in_one_line(node, tmp_path):
    for flag in ("--json-schema", "--grammar", "--tls-ca", "--token-file"):
        result = node_chat(node, flag, str(tmp_path / "missing"), "hi")
        assert result.returncode == 2, result.stderr
        assert result.stderr == f"tandem-node: {flag}: cannot read {tmp_path / 'missing'} (no such file or directory)\n"
