"""The Node.js client (clients/node, protos loaded at run time) streams the same greedy chat answer
as the Python client, and loads, lists, pins and unloads LoRA adapters as it does (admin.js, `node chat.js
admin lora ...`). `make install` runs `npm ci` there; without npm this test cannot run."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest

from clients.client import TandemClient
from engine_core.loader import default_model_path
from tests.clients.conftest import REPO
from tests.engine_core.tiny_lora import write_tiny_adapter
from tests.engine_core.tiny_models import write_tiny_model
from tests.test_stack import ENGINE_FLAGS, VOCAB, Services

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


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory):
    """An engine serving LoRA with none loaded (--max-lora-rank 8), an adapter of rank 4 and one of rank 16."""
    root = tmp_path_factory.mktemp("node-lora")
    model_dir = write_tiny_model(root / "model", vocab_size=VOCAB, max_position_embeddings=512)
    targets = ["q_proj", "v_proj"]
    services = Services(["--model", str(model_dir), *ENGINE_FLAGS, "--log-level", "WARNING", "--enable-lora",
                         "--max-loras", "2", "--max-lora-rank", "8"],
                        ["--tokenizer", str(default_model_path()), "--log-level", "WARNING"])
    services.adapters = {name: write_tiny_adapter(model_dir, root / name, rank=rank, seed=seed, target_modules=targets)
                         for name, rank, seed in (("small", 4, 1), ("wide", 16, 2))}
    try:
        yield services
    finally:
        services.stop()


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


def test_node_reads_a_call_whose_arguments_are_not_a_whole_object_as_cut(node):
    """chat.js's readToolCall, as the Python client's ToolCall: arguments null and complete false for arguments
    max_tokens cut (the raw text kept), the object for a whole call; nothing throws."""
    cases = ['{"city": "Os', "", '{"city": "Oslo"', '"Oslo"', "[1]", "null", '{"city": "Oslo", "days": 2}']
    script = """
const { readToolCall } = require(process.argv[1]);
const cases = JSON.parse(process.argv[2]);
console.log(JSON.stringify(cases.map((a) => readToolCall({ id: 'call_1', name: 'get_weather', arguments_json: a }))));
"""
    result = subprocess.run([node, "-e", script, str(NODE_DIR / "chat.js"), json.dumps(cases)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = json.loads(result.stdout)
    assert [(c["complete"], c["arguments"], c["arguments_json"]) for c in calls[:-1]] == [
        (False, None, a) for a in cases[:-1]]
    assert (calls[-1]["complete"], calls[-1]["arguments"]) == (True, {"city": "Oslo", "days": 2})
    assert (calls[-1]["id"], calls[-1]["name"], calls[-1]["index"]) == ("call_1", "get_weather", 0)


def test_node_names_an_unreadable_file_in_one_line(node, tmp_path):
    for flag in ("--json-schema", "--grammar", "--tls-ca", "--token-file"):
        result = node_chat(node, flag, str(tmp_path / "missing"), "hi")
        assert result.returncode == 2, result.stderr
        assert result.stderr == f"tandem-node: {flag}: cannot read {tmp_path / 'missing'} (no such file or directory)\n"


def test_node_loads_lists_pins_and_unloads_lora_adapters(node, lora_stack):
    address, engine, path = lora_stack.frontend_address, lora_stack.engine_address, str(lora_stack.adapters["small"])
    loaded = node_chat(node, "admin", "lora", "load", "sql", path, "--address", address)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout == f"sql\trank 4\tq_proj,v_proj\thost\tunpinned\t{engine}\t{path}\n"
    listed = node_chat(node, "admin", "lora", "list", "--json", "--address", address)
    assert listed.returncode == 0, listed.stderr
    with TandemClient(address, timeout=60) as client:  # the same adapters as the Python client lists them
        python_listed = [dataclasses.asdict(a) for a in client.list_loras()]
        assert [{**a, "target_modules": tuple(a["target_modules"])} for a in json.loads(listed.stdout)] == python_listed
        expected = "".join(c.text for c in client.chat([{"role": "user", "content": "Hi"}], temperature=0,
                                                       max_tokens=8, ignore_eos=True, lora_name="sql"))
    answer = node_chat(node, "--address", address, "--lora", "sql", "--temperature", "0", "--max-tokens", "8",
                       "--ignore-eos", "Hi")
    assert answer.returncode == 0 and answer.stdout == expected + "\n", answer.stderr
    pinned = node_chat(node, "admin", "lora", "pin", "sql", "--address", address)
    assert pinned.returncode == 0 and "\tpinned\t" in pinned.stdout, pinned.stderr
    unloaded = node_chat(node, "admin", "lora", "unload", "sql", "--address", address)
    assert unloaded.returncode == 0 and unloaded.stdout == f"unloaded sql from {engine}\n", unloaded.stderr
    # refusals: the server's status in one line, exit 1; a missing argument: exit 2 before any call
    for args, code, words in [(("unload", "sql"), "NOT_FOUND", "not loaded"),
                              (("pin", "sql"), "NOT_FOUND", "not loaded"),
                              (("load", "wide", str(lora_stack.adapters["wide"])), "INVALID_ARGUMENT",
                               "above max_lora_rank 8")]:
        refused = node_chat(node, "admin", "lora", *args, "--address", address)
        assert refused.returncode == 1 and refused.stdout == "", refused.stderr
        assert refused.stderr.startswith(f"tandem-node: {code}:") and words in refused.stderr, refused.stderr
    missing = node_chat(node, "admin", "lora", "load", "sql", "--address", address)
    assert missing.returncode == 2 and "lora load needs NAME and PATH" in missing.stderr


def test_node_admin_client_is_a_library(node, lora_stack):
    """admin.js's AdminClient: the Python client's load_lora, list_loras, pin_lora and unload_lora as promises."""
    script = """
const { AdminClient } = require(process.argv[1]);
(async () => {
  const admin = new AdminClient(process.argv[2]);
  try {
    const loaded = await admin.loadLora('lib', process.argv[3]);
    const pinned = await admin.pinLora('lib');
    const listed = await admin.listLoras();
    const engines = await admin.unloadLora('lib');
    const refused = await admin.unloadLora('lib').catch((error) => [error.code, error.details]);
    console.log(JSON.stringify({ loaded, pinned, listed, engines, refused }));
  } finally {
    admin.close();
  }
})();
"""
    result = subprocess.run([node, "-e", script, str(NODE_DIR / "admin.js"), lora_stack.frontend_address,
                             str(lora_stack.adapters["small"])], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [(a["name"], a["rank"], a["pinned"], a["engine"]) for a in out["loaded"]] == [
        ("lib", 4, False, lora_stack.engine_address)]
    assert out["pinned"][0]["pinned"] and "lib" in [a["name"] for a in out["listed"]]
    assert out["engines"] == [lora_stack.engine_address]
    assert out["refused"][0] == 5 and "not loaded" in out["refused"][1]  # grpc.status.NOT_FOUND
