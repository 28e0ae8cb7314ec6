"""Every ```python and ```bash block of README.md and docs/*.md runs, or is named here with why not.

Python blocks run as scripts in a subprocess from the repository's root; shell blocks run command by command
(backslash continuations and quotes that span lines joined) in bash. Both talk to a live stack on loopback (a
tiny random Llama with SmolLM2's tokenizer, with the context the docs' tool prompts need), by the docs'
convention: the docs write the default address, localhost:50051, and a client command written without --address
means it too; this test points both at the live stack. A `# -> TEXT` comment on a command says it fails and
prints TEXT (on stderr).

A command is run when it is a client command of the tandem CLI or the Node client (`node clients/node/chat.js`,
where node is installed), or `--help` of a service, that SKIPPED does not name; every other command must match
SKIPPED, whose reasons say why it is not run here and, where one does, which test runs it. A command that
matches neither fails the test: a new snippet is never silently left out.
Python blocks that load the embedded SmolLM2 in-process run in the slow tier (make test-slow).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCS_ADDRESS = "localhost:50051"
CLIENT_COMMANDS = ("generate", "chat", "tokenize", "embed", "info", "health", "admin")
NODE_CHAT = "clients/node/chat.js"  # the Node client; run where node (and `make install`'s npm ci) is
EXPECTED_FAILURE = re.compile(r"#\s*->\s*(.+)$")  # `# -> tandem: INVALID_ARGUMENT: ...`

# (regex matched against the command as written, why it is not run here)
SKIPPED = [
    (r"make (run|test|install|protos|proto-check|api-docs|ts-stubs|proto-baseline|bench|gpu-check)\b",
     "make targets install into .venv and run the demo, test tiers, benchmarks or code generation for minutes; "
     "CI (.ci/run) runs them"),
    (r"make (run-gateway|test-faults|test-faults-long)\b", "runs for minutes (the gateway demo, the fault suite)"),
    (r"pip install\b", "installs packages (tests/install builds and installs the wheel)"),
    (r"(\.venv/bin/)?tandem serve\b",
     "serves on the fixed ports 50051/50061 until Ctrl-C; tests/clients/test_serve.py runs tandem serve on free ports"),
    (r"(\.venv/bin/)?tandem-(engine|frontend) (?!--help)",
     "starts a server on a fixed port until stopped (or at a placeholder host or model path); tests/test_stack.py "
     "and tests/services start the services on free ports"),
    (r"buf curl --protocol grpc --http2-prior-knowledge\b.* http://localhost:50051(/|$)",
     "tests/clients/test_reflection_client.py runs every plaintext buf curl command against a live stack"),
    (r"buf curl --protocol grpc --cacert", "TLS at a placeholder host (frontend-box); tests/security runs TLS stacks"),
    (r"export PATH=", "sets up the shell for the next commands; nothing to check"),
    (r"node clients/node/chat\.js (admin lora|.*--lora sql\b)",
     "needs a PEFT adapter folder at /adapters/sql (a placeholder) and an engine started with LoRA; "
     "tests/clients/test_node_client.py loads, pins and unloads adapters and answers with one"),
    (r"tandem admin lora (load|list|pin|unload)\b",
     "needs a PEFT adapter folder at /adapters/sql (a placeholder) and an engine started with LoRA; "
     "tests/test_lora_stack.py runs tandem admin lora against one"),
    (r"tandem (generate|chat) .*--lora sql\b",
     "needs an engine with the adapter sql loaded (from a placeholder folder); "
     "tests/clients/test_chat_cli_scripted.py sends --lora to a scripted engine that has it"),
    (r"(docker|open|kubectl|REGISTRY=|bash scripts/docker_standins\.sh|build/compose-venv/)",
     "Docker, Kubernetes or a browser, which the test machines do not have; tests/compose, tests/deploy and "
     "tests/observability/test_compose.py check the files these use"),
    (r"curl -s localhost:(30000|8051)", "needs the smg gateway or the compose stack; tests/gateway and "
     "tests/observability run them"),
    (r"smg launch", "starts the smg gateway on a fixed port until stopped; tests/gateway starts it on a free one"),
    (r"TANDEM_API_TOKEN=\$\(cat api\.token\) tandem chat --address localhost:50051 ",
     "a cluster's port-forward with its tokens and certificates (docs/deployment.md's Kubernetes steps)"),
    (r"(openssl|leaf|kubectl)\b", "certificates and secrets for a cluster: tests/security/test_readme_certificates.py "
     "runs the OpenSSL recipe, tests/deploy checks the secrets"),
    (r"(mkdir -p build/gen/go && )?protoc ", "needs protoc and the Go plugins; tests/api/test_go_stubs.py runs it "
     "where they are installed"),
    (r"\.venv/bin/python scripts/bench_", "a benchmark: minutes of a busy machine (docs/benchmarks.md)"),
    (r"(\.venv/bin/)?tandem plans\b", "reads (or clears) this machine's plan cache, not a server; "
     "tests/clients/test_plans_command.py runs it on a cache folder of its own"),
]
# Whole blocks that are one recipe, not separate commands: (page, first line's start, why)
SKIPPED_BLOCKS = [
    ("deployment.md", "openssl req -x509", "certificates and secrets for a cluster: "
     "tests/security/test_readme_certificates.py runs the OpenSSL recipe, tests/deploy checks the secrets"),
]
# Python blocks that load the embedded SmolLM2 in-process: the slow tier
IN_PROCESS = re.compile(r"\bLLM\(|LLMEngine\(|LLMEngine\.from_engine_args")
# Python blocks not run: (page, a string in the block, why)
SKIPPED_PYTHON = [
    ("lora.md", 'client.load_lora("sql", "/adapters/sql")',
     "needs a PEFT adapter folder at /adapters/sql (a placeholder) and an engine started with LoRA; "
     "tests/test_lora_stack.py makes both and runs the same client calls"),
]


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks() -> list[Block]:
    blocks = []
    for page in DOC_PAGES:
        language, start, lines = None, 0, []
        for number, line in enumerate(page.read_text().splitlines(), 1):
            fence = re.match(r"^```(\w*)\s*$", line)
            if fence and language is None:
                language, start, lines = fence.group(1), number, []
            elif line.startswith("```") and language is not None:
                if language in ("python", "bash"):
                    blocks.append(Block(page.relative_to(REPO).as_posix(), start, language, "\n".join(lines)))
                language = None
            elif language is not None:
                lines.append(line)
    return blocks


def shell_commands(text: str) -> list[tuple[str, str | None]]:
    """(command, expected failure text or None) per command: continuations and multi-line quotes joined,
    comment-only lines dropped."""
    commands, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote goes on over the next line
            pending += "\n"
            continue
        expected = EXPECTED_FAILURE.search(pending)
        commands.append((pending.strip(), expected.group(1).strip() if expected else None))
        pending = ""
    return commands


def skip_reason(block: Block, command: str) -> str | None:
    for page, start, why in SKIPPED_BLOCKS:
        if block.page.endswith(page) and block.text.lstrip().startswith(start):
            return why
    return next((why for pattern, why in SKIPPED if re.match(pattern, command, re.DOTALL)), None)


def runs_here(block: Block, command: str) -> bool:
    """A client command of the tandem CLI or the Node client, or a service's --help, that no SKIPPED rule names."""
    if skip_reason(block, command) is not None:
        return False
    words = shlex.split(command, comments=True)
    if words[:2] == ["node", NODE_CHAT]:
        return True
    tandem = [i for i, w in enumerate(words) if re.fullmatch(r"(\.venv/bin/)?tandem", w)]
    if tandem and len(words) > tandem[0] + 1 and words[tandem[0] + 1] in CLIENT_COMMANDS:
        return True
    return bool(re.fullmatch(r"(\.venv/bin/)?tandem-(engine|frontend)", words[0])) and words[1:] == ["--help"]


BLOCKS = code_blocks()
SHELL = [(block, command, expected) for block in BLOCKS if block.language == "bash"
         for command, expected in shell_commands(block.text)]


def shell_environment(address: str) -> str:
    """Bash functions that run the worktree's CLI and services as a user runs the installed ones, with client
    commands pointed at `address`."""
    python = shlex.quote(sys.executable)
    return (f"tandem() {{ {python} -m clients.cli \"$@\" --address {address}; }}\n"
            f"node() {{ command node \"$@\" --address {address}; }}\n"
            f"tandem-engine() {{ {python} -m services.engine \"$@\"; }}\n"
            f"tandem-frontend() {{ {python} -m services.frontend \"$@\"; }}\n")


def run_shell(command: str, address: str) -> subprocess.CompletedProcess:
    command = re.sub(r"(^|[|&;]\s*)\.venv/bin/", r"\1", command.replace(f"--address {DOCS_ADDRESS}", ""))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TANDEM_API_TOKEN", None)
    return subprocess.run(["bash", "-c", shell_environment(address) + command], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def docs_stack(tmp_path_factory):
    """A stack of the docs' own (their admin commands pause it), with room for the tool examples' prompts."""
    from engine_core.loader import default_model_path
    from tests.engine_core.tiny_models import write_tiny_model
    from tests.test_stack import ENGINE_FLAGS, VOCAB, Services

    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-docs"), vocab_size=VOCAB, max_position_embeddings=1024)
    flags = [*ENGINE_FLAGS, "--log-level", "WARNING", "--tokenizer", str(default_model_path())]
    flags[flags.index("--max-model-len") + 1] = "1024"  # docs/tools.md's prompt has 360 tokens
    services = Services(["--model", str(model_dir), *flags],
                        ["--tokenizer", str(default_model_path()), "--log-level", "WARNING"])
    try:
        yield services
    finally:
        services.stop()


# ---- the catalogue: nothing left out silently ---------------------------------------------------------------
def test_every_shell_command_is_run_or_skipped_with_a_reason():
    unknown = [f"{block}: {command}" for block, command, _ in SHELL
               if not runs_here(block, command) and skip_reason(block, command) is None]
    assert not unknown, "commands neither run nor in SKIPPED (run them or add a reason):\n" + "\n".join(unknown)
    assert sum(runs_here(block, command) for block, command, _ in SHELL) >= 15


def test_every_skip_rule_still_matches_a_snippet():
    """A rule no snippet needs any more goes, so the list says only what is true."""
    for pattern, _ in SKIPPED:
        assert any(re.match(pattern, command, re.DOTALL) for _, command, _ in SHELL), pattern
    for page, text, _ in SKIPPED_PYTHON:
        assert any(b.page.endswith(page) and text in b.text for b in BLOCKS if b.language == "python"), text


# ---- running them -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block, command, expected", [
    pytest.param(b, c, e, id=f"{b}:{c[:50]}") for b, c, e in SHELL if runs_here(b, c)])
def test_shell_command_runs(docs_stack, block, command, expected):
    if command.startswith("node "):
        if shutil.which("node") is None:
            pytest.skip("node is not installed")
        if not (REPO / "clients" / "node" / "node_modules" / "@grpc" / "grpc-js").is_dir():
            pytest.fail("clients/node has no node_modules: run `make install` (it runs `npm ci` there)")
    result = run_shell(command, docs_stack.frontend_address)
    if expected is None:
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
    else:
        assert result.returncode != 0 and expected in result.stderr, (command, expected, result.stderr)


def python_cases():
    for block in BLOCKS:
        if block.language != "python":
            continue
        skipped = next((why for page, text, why in SKIPPED_PYTHON if block.page.endswith(page) and text in block.text),
                       None)
        marks = [pytest.mark.skip(reason=skipped)] if skipped else []
        if IN_PROCESS.search(block.text):
            marks.append(pytest.mark.slow)  # loads the embedded SmolLM2 in this process: minutes on a fresh cache
        yield pytest.param(block, marks=marks, id=str(block))


@pytest.mark.parametrize("block", list(python_cases()))
def test_python_block_runs(request, block):
    text = block.text
    if DOCS_ADDRESS in text:
        text = text.replace(DOCS_ADDRESS, request.getfixturevalue("docs_stack").frontend_address)
    result = subprocess.run([sys.executable, "-c", text], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, (str(block), result.stdout[-2000:], result.stderr[-3000:])
