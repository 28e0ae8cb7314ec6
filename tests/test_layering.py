"""DESIGN's import rules, checked on the source: generated protos only at the edges; one class per shared type.

Message classes (`*_pb2`) are built and read only in the convert modules, the servicers and
clients/messages.py; stubs and servicer bases (`*_pb2_grpc`) only where a channel or server is wired.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from tandem.v1 import common_pb2

from engine_core.sampling_params import FinishReason, OutputKind

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_core", "kernels", "services", "clients")

# Files that may import generated message modules (*_pb2).
MESSAGE_MODULES = {
    "services/sampling_convert.py",  # the shared types <-> common.proto, for both services
    "services/engine/convert.py",
    "services/frontend/convert.py",
    "services/frontend/vllm_engine_convert.py",  # vLLM's worker protocol (smg-grpc-proto) <-> the dataclasses
    "services/frontend/vllm_engine_servicer.py",
    "clients/messages.py",
    "clients/embeddings.py",
    "clients/admin.py",
    "services/engine/grpc_service.py",  # servicers (request/response types in signatures, reflection names)
    "services/frontend/server.py",
    "services/engine/health.py",  # the grpc.health.v1 servicers
    "services/frontend/health.py",
    "clients/local_stack.py",  # waits on grpc.health.v1 before handing out a stack
}
# Files that may import stubs and servicer bases (*_pb2_grpc).
WIRING = {
    "services/engine/grpc_service.py",
    "services/engine/health.py",
    "services/frontend/health.py",
    "services/frontend/server.py",
    "services/frontend/vllm_engine_servicer.py",
    "services/frontend/engine_connection.py",
    "clients/client.py",
    "clients/async_client.py",
    "clients/local_stack.py",
}


def python_files(*packages: str) -> list[Path]:
    files = [p for package in packages for p in (ROOT / package).rglob("*.py")]
    return sorted(p for p in files if "node_modules" not in p.parts)


def imported_modules(path: Path) -> set[str]:
    """Every module name an import statement in `path` names (`from a import b` gives a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_generated_messages_are_imported_only_at_the_edges():
    offenders = {}
    for path in python_files(*PACKAGES):
        rel = path.relative_to(ROOT).as_posix()
        modules = imported_modules(path)
        messages = sorted(m for m in modules if m.endswith("_pb2"))
        stubs = sorted(m for m in modules if m.endswith("_pb2_grpc"))
        if messages and rel not in MESSAGE_MODULES:
            offenders[rel] = messages
        if stubs and rel not in WIRING:
            offenders[rel] = offenders.get(rel, []) + stubs
    assert not offenders, f"generated protos imported outside the convert/servicer/stub modules: {offenders}"


def test_engine_core_knows_nothing_of_grpc_or_services():
    for path in python_files("engine_core"):
        bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("grpc", "tandem", "services", "clients"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_clients_import_no_engine_core():
    """The client library, CLI and benchmark reach the engine only through the frontend (even lazily;
    the transformers peer imports torch for transformers' own sake)."""
    for path in python_files("clients"):
        bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("engine_core", "kernels"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("concept", ["SamplingParams", "FinishReason", "OutputKind", "TokenLogprobs",
                                     "StructuredOutput"])
def test_one_class_per_shared_concept(concept):
    pattern = re.compile(rf"^class {concept}\b", re.MULTILINE)
    defining = [p.relative_to(ROOT).as_posix() for p in python_files(*PACKAGES) if pattern.search(p.read_text())]
    assert defining == ["engine_core/sampling_params.py"], defining


def test_shared_enums_are_numbered_like_the_protos():
    for reason in FinishReason:
        assert common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason
    for kind in OutputKind:
        assert common_pb2.OutputKind.Value(f"OUTPUT_KIND_{kind.name}") == kind
    assert len(common_pb2.FinishReason.values()) == len(FinishReason) + 1  # + UNSPECIFIED
    assert len(common_pb2.OutputKind.values()) == len(OutputKind) + 1
