"""What `pip install .` and `pip install '.[engine]'` bring, read from the metadata the build makes.

pip resolves dependencies from the wheel's METADATA (Requires-Dist), so that is what is checked,
made here by setuptools from pyproject.toml exactly as the build backend does, without a slow
install: the plain install (client, CLI, frontend) must not reach torch, even through a
dependency; the engine extra must pin it exactly; building must not need it either.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.observability.test_compose import with_dependencies

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def requirements(tmp_path_factory) -> list[Requirement]:
    out = tmp_path_factory.mktemp("metadata")
    code = ("import sys, setuptools.build_meta as backend; "
            "print(backend.prepare_metadata_for_build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True,
                            check=True, timeout=120)
    dist_info = out / result.stdout.split()[-1]
    return [Requirement(spec) for spec in metadata.PathDistribution(dist_info).requires]


def _for_extras(requirements: list[Requirement], *extras: str) -> list[Requirement]:
    return [r for r in requirements
            if r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in extras)]


def test_the_plain_install_has_no_torch_even_indirectly(requirements):
    plain = _for_extras(requirements)
    assert plain and not any(r.name in ("torch", "triton", "transformers") for r in plain)
    assert "torch" not in with_dependencies({r.name for r in plain})  # as installed here


def test_the_engine_extra_pins_torch_exactly(requirements):
    engine = {r.name: r for r in _for_extras(requirements, "engine")}
    assert str(engine["torch"].specifier) == "==2.13.0"
    assert "safetensors" in engine


def test_building_needs_no_torch():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    names = {Requirement(spec).name for spec in build["requires"]}
    assert "grpcio-tools" in names  # generates tandem.v1 from protos/ during the build
    assert "torch" not in with_dependencies(names)
    assert (ROOT / build["backend-path"][0] / f"{build['build-backend']}.py").is_file()
