"""The README's Go command, run from the repository's root as written: the proto files it names exist
there, lie under its -I folder, and protoc (where it and the Go plugins are installed) makes the stubs."""

from __future__ import annotations

import glob
import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.api.conftest import PROTOS, REPO

_SPEC = importlib.util.spec_from_file_location("gen_api_docs", REPO / "scripts" / "gen_api_docs.py")
gen_api_docs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gen_api_docs)


def documented_command() -> str:
    """The README's Go line (continuations joined, the comment dropped)."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
             for line in block.splitlines() if "--go_out" in line]
    assert len(lines) == 1, lines
    return " ".join(shlex.split(lines[0], comments=True))


def test_the_readme_and_the_api_reference_give_the_same_command():
    command = documented_command()
    assert command == " ".join(shlex.split(gen_api_docs.GO_STUBS))
    assert f"`{gen_api_docs.GO_STUBS}`" in (REPO / "docs" / "api.md").read_text()


def test_the_files_it_names_exist_from_the_repository_root():
    """protoc takes file paths relative to the current folder, each under an -I folder (the old command
    named tandem/v1/*.proto, which exists only under protos/, and failed)."""
    words = shlex.split(documented_command().split("&&")[-1])
    assert words[0] == "protoc"
    includes = [REPO / words[i + 1] for i, word in enumerate(words) if word == "-I"]
    sources = [word for word in words[1:] if not word.startswith("-") and (REPO / word) not in includes]
    assert sources
    for pattern in sources:
        found = [Path(p) for p in glob.glob(str(REPO / pattern))]
        assert found, f"{pattern} matches nothing from the repository's root"
        for path in found:
            assert any(path.is_relative_to(folder) for folder in includes), f"{path} is under no -I folder"
    assert {p.name for p in found} == {p.name for p in (PROTOS / "tandem" / "v1").glob("*.proto")}


def test_protoc_makes_the_go_stubs(tmp_path):
    missing = [tool for tool in ("protoc", "protoc-gen-go", "protoc-gen-go-grpc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (Debian: protobuf-compiler protoc-gen-go protoc-gen-go-grpc)")
    shutil.copytree(PROTOS, tmp_path / "protos")  # a copy of the root, so build/ here stays untouched
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", documented_command()], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    made = sorted(p.name for p in (tmp_path / "build" / "gen" / "go" / "tandem" / "v1").glob("*.go"))
    assert made == ["admin.pb.go", "admin_grpc.pb.go", "common.pb.go", "engine_core.pb.go",
                    "engine_core_grpc.pb.go", "generation.pb.go", "generation_grpc.pb.go"]
