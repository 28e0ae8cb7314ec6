"""DESIGN's import rules, checked on the source: generated protos only at the edges; one class per shared type.

Message classes (`*_pb2`) are built and read only in the convert modules, the servicers and
clients/generation.py; stubs and servicer bases (`*_pb2_grpc`) only where a channel or server is wired.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from tandem.v1 import common_pb2, engine_core_pb2

import engine_core.protocol
import kernels
from engine_core.protocol import (
    EngineCoreEventType,
    FinishReason,
    OutputKind,
    PauseMode,
    RequestErrorKind,
    UtilityMethod,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_core", "kernels", "services", "clients")

# Files that may import generated message modules (*_pb2).
MESSAGE_MODULES = {
    "services/sampling_convert.py",  # the shared types <-> common.proto, for both services
    "services/engine/convert.py",
    "services/frontend/convert.py",
    "services/frontend/tools/convert.py",  # the tool-calling fields of Chat (called by frontend/convert.py)
    "services/frontend/gateway/convert.py",  # vLLM's worker protocol (smg-grpc-proto) <-> the dataclasses
    "services/frontend/gateway/servicer.py",
    "clients/generation.py",
    "clients/embeddings.py",
    "clients/tools.py",  # tool calling's typed request and result, like embeddings.py
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
    "services/frontend/gateway/servicer.py",
    "services/frontend/engines/connection.py",
    "clients/client.py",
    "clients/async_client.py",
    "clients/local_stack.py",
}


def python_files(*packages: str) -> list[Path]:
    files = [p for package in packages for p in (ROOT / package).rglob("*.py")]
    return sorted(p for p in files if "node_modules" not in p.parts)


def imported_modules(path: Path, top_level_only: bool = False) -> set[str]:
    """Every module name an import statement in `path` names (`from a import b` gives a and a.b);
    top_level_only: not those inside functions (lazy imports)."""
    names = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (ast.iter_child_nodes(tree) if top_level_only else ast.walk(tree)):
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


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_the_protocol_loads_neither_torch_nor_the_rest_of_engine_core():
    _run("import engine_core.protocol, sys; "
         "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels', 'services') or "
         "(m.startswith('engine_core.') and not m.startswith('engine_core.protocol'))]; "
         "assert not bad, bad")


# What the frontend may import of engine_core: the shared types, and the model's text (tokenizer, detokenizer,
# chat template), both torch-free.
FRONTEND_SHARES = ("engine_core.protocol", "engine_core.text")


def test_the_frontend_imports_only_the_protocol_and_text_of_engine_core():
    """In the source (the in-process transport's lazy import of the engine aside), and once loaded."""
    for path in python_files("services/frontend"):
        lazy_engine = path.name == "in_process.py"  # starts an engine in this process on request
        bad = sorted(m for m in imported_modules(path, top_level_only=lazy_engine)
                     if m.split(".")[0] == "kernels"
                     or (m.split(".")[0] == "engine_core" and not m.startswith(FRONTEND_SHARES)))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    _run("import services.frontend.server, services.frontend.__main__, sys; "
         "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels') or "
         f"(m.startswith('engine_core.') and not m.startswith({FRONTEND_SHARES!r}))]; "
         "assert not bad, bad")


def test_the_text_readers_load_neither_torch_nor_the_engine():
    _run("import engine_core.text.tokenizer, engine_core.text.detokenizer, engine_core.text.chat_template, sys; "
         "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels', 'services') or "
         f"(m.startswith('engine_core.') and not m.startswith({FRONTEND_SHARES!r}))]; "
         "assert not bad, bad")


def test_the_engine_reaches_the_kernels_only_through_their_front_door():
    """engine_core and services import `kernels` (its __init__) and nothing deeper."""
    for path in python_files("engine_core", "services"):
        deeper = sorted(m for m in imported_modules(path)
                        if m.startswith("kernels.") and m.split(".")[1] not in kernels.__all__)
        assert not deeper, f"{path.relative_to(ROOT)} imports {deeper}"


PROTOCOL_CLASSES = sorted(name for name in engine_core.protocol.__all__
                          if isinstance(getattr(engine_core.protocol, name), type)
                          and getattr(engine_core.protocol, name).__module__.startswith("engine_core.protocol"))


@pytest.mark.parametrize("concept", PROTOCOL_CLASSES)
def test_one_class_per_protocol_concept(concept):
    """Every type that crosses the frontend <-> engine boundary is defined once, in engine_core/protocol/ (the
    client library, which imports no engine_core, has its own public types)."""
    pattern = re.compile(rf"^class {concept}\b", re.MULTILINE)
    defining = [p.relative_to(ROOT).as_posix() for p in python_files("engine_core", "services", "kernels")
                if pattern.search(p.read_text())]
    assert len(defining) == 1 and defining[0].startswith("engine_core/protocol/"), defining


REFERENCE_NAME = re.compile(r"reference\w*|ref_\w*|\w*_reference")


def test_every_kernels_reference_lives_in_kernels_reference():
    """The plain-torch reference of every kernel is in one place, kernels/reference/: a test under tests/kernels
    imports it from there and writes none of its own (no `reference*`, `ref_*` or `*_reference` function)."""
    for path in sorted((ROOT / "tests" / "kernels").rglob("*.py")):
        own = sorted(node.name for node in ast.walk(ast.parse(path.read_text(), str(path)))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and REFERENCE_NAME.fullmatch(node.name) and not node.name.startswith("test_"))
        assert not own, f"{path.relative_to(ROOT)} defines {own}: put it in kernels/reference/ and import it"



# A measured figure in a comment is true of one machine on one day and goes stale unseen: the docs keep each
# with its machine and date (docs/benchmarks.md#every-figure), the code one sentence of why and a link there.
MEASURED_FIGURE = re.compile(
    r"(?<![\w.])~?\d[\d,.]*\s?(?:ms|us|µs|ns)\b"  # a duration
    r"|\d[\d,.]*\s(?:\w+\s)?tok(?:ens)?/s\b"  # a token rate
    r"|\d[\d,.]*\s?(?:[KMGT]i?B|G?FLOP|G?OP|G vpdpbusd)/s"  # a bandwidth, a throughput
    r"|(?<![\w.])~?\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?x(?!\w)(?!\s?\d)"  # a ratio: 1.4-1.65x, ~10x
    r"|\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\d+\s?%\s+(?:faster|slower)")  # a speed-up
DOC_LINK = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")


def shipped_sources() -> list[Path]:
    """The Python, C++ and header files of the shipped packages."""
    files = [p for package in PACKAGES for pattern in ("*.py", "*.cpp", "*.h", "*.cu")
             for p in (ROOT / package).rglob(pattern)]
    return sorted(p for p in files if "node_modules" not in p.parts)


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line: Python's `#` comments and docstrings, C++'s
    `//` and `/* */` comments."""
    text = path.read_text()
    if path.suffix != ".py":
        comments = re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S)
        return [(text.count("\n", 0, m.start()) + 1 + i, line)
                for m in comments for i, line in enumerate(m.group().splitlines())]
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                lines += [(doc.lineno + i, line) for i, line in enumerate(doc.value.value.splitlines())]
    return lines


def test_shipped_comments_carry_no_measured_figures():
    """No ms, us, tok/s, GB/s, "1.4-1.65x" or date in a comment or docstring of shipped code: each belongs in the
    docs, dated, with its machine (docs/benchmarks.md), and the comment links to it."""
    found = {}
    for path in shipped_sources():
        rel = path.relative_to(ROOT).as_posix()
        hits = [f"{line}: {text.strip()}" for line, text in comment_lines(path) if MEASURED_FIGURE.search(text)]
        if hits:
            found[rel] = hits
    assert not found, f"measured figures in comments (move them to the docs and link there): {found}"


def test_the_docs_the_code_links_to_exist():
    """Every docs/PAGE.md#heading a comment of shipped code names is a page with that heading."""
    from tests.test_readme_paths import anchors

    broken = []
    for path in shipped_sources():
        for line, text in comment_lines(path):
            for page, anchor in DOC_LINK.findall(text):
                target = ROOT / "docs" / page
                if not target.is_file() or (anchor and anchor not in anchors(target)):
                    broken.append(f"{path.relative_to(ROOT).as_posix()}:{line}: docs/{page}#{anchor}")
    assert not broken, broken

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, lazily too, but not under `if TYPE_CHECKING:` (never run)."""
    found: set[str] = set()

    class Imports(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)

    Imports().visit(ast.parse(path.read_text(), str(path)))
    return found & modules


def test_no_import_cycles_between_modules():
    """A cycle makes two modules one concept in two files, and import order a hazard. A package importing its
    own modules (a front door such as kernels/__init__.py) and a module importing its package do not count."""
    paths = {_module_name(p): p for p in python_files(*PACKAGES)}
    graph = {name: {m for m in _runtime_imports(path, set(paths))
                    if m != name and not name.startswith(m + ".") and not m.startswith(name + ".")}
             for name, path in paths.items()}
    cycles, done = [], set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


# Modules at a package's root, at most: past that, name prefixes start doing the work of folders.
MAX_MODULES_AT_A_ROOT = 15


def test_no_package_root_holds_more_than_15_modules():
    over = {}
    for package in PACKAGES:
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            if "node_modules" in folder.parts or not (folder / "__init__.py").exists():
                continue
            count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
            rel = folder.relative_to(ROOT).as_posix()
            if count > MAX_MODULES_AT_A_ROOT:
                over[rel] = count
    assert not over, f"packages past {MAX_MODULES_AT_A_ROOT} modules at their root (split them into folders): {over}"


def test_shared_enums_are_numbered_like_the_protos():
    for reason in FinishReason:
        assert common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason
    for kind in OutputKind:
        assert common_pb2.OutputKind.Value(f"OUTPUT_KIND_{kind.name}") == kind
    assert len(common_pb2.FinishReason.values()) == len(FinishReason) + 1  # + UNSPECIFIED
    assert len(common_pb2.OutputKind.values()) == len(OutputKind) + 1
    for name, enum, prefix, proto in (("PauseMode", PauseMode, "PAUSE_MODE", common_pb2.PauseMode),
                                      ("UtilityMethod", UtilityMethod, "UTILITY_METHOD", engine_core_pb2.UtilityMethod),
                                      ("EngineCoreEventType", EngineCoreEventType, "ENGINE_CORE_EVENT_TYPE",
                                       engine_core_pb2.EngineCoreEventType)):
        assert {member.name: int(member) for member in enum} == {
            key[len(prefix) + 1:]: value for key, value in proto.items() if value}, name
    assert RequestErrorKind.ASLEEP == engine_core_pb2.REQUEST_ERROR_KIND_ASLEEP
    assert RequestErrorKind.INVALID == engine_core_pb2.REQUEST_ERROR_KIND_UNSPECIFIED
