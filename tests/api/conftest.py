"""The API contract checks run the tools that `make install` puts in clients/node (buf, tsc)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"
NODE_BIN = REPO / "clients" / "node" / "node_modules" / ".bin"
BASELINE = PROTOS / "baseline" / "tandem-v1.binpb"


@pytest.fixture(scope="session")
def buf() -> Path:
    """clients/node's pinned buf; skipped only where npm (so buf) cannot be installed at all."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node and npm are not installed, so make install could not install buf")
    path = NODE_BIN / "buf"
    if not path.exists():
        pytest.fail("clients/node has no buf: run `make install` (it runs `npm ci` in clients/node)")
    return path


def run(*args, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
