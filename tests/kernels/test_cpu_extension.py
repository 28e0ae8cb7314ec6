"""Building the C++ CPU kernels is never required: without a compiler the CPU path is pure torch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kernels import select_backend
from kernels.cpu import extension as cpu_extension
from kernels.fused_ops import select_fused_ops


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "tandem-no-such-compiler")
    cpu_extension.load.cache_clear()
    yield
    cpu_extension.load.cache_clear()  # later tests load the real build again


def test_without_a_compiler_the_cpu_path_is_pure_torch(no_compiler, caplog):
    with caplog.at_level("INFO", logger="kernels.cpu.extension"):
        assert cpu_extension.compiler() is None and cpu_extension.load() is False
    assert "no C++ compiler" in caplog.text
    assert select_backend("cpu").name == "torch"
    assert select_fused_ops("cpu", torch.bfloat16) is None
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        select_backend("cpu", "cpp")


@pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")
def test_with_a_compiler_auto_picks_the_cpp_kernels():
    assert cpu_extension.load()
    assert select_backend("cpu").name == "cpp"
    assert select_backend("cpu", "torch").name == "torch"
    built = list(cpu_extension.cache_dir().glob("tandem_cpu_kernels_*/*.so"))
    assert built, f"no library under {cpu_extension.cache_dir()}"


def test_each_checkout_has_its_own_build_folder_for_the_same_sources(tmp_path, monkeypatch):
    """build.ninja holds the sources' absolute paths: a folder shared by two checkouts was rebuilt
    whenever the other one had used it last."""
    here_name, here = cpu_extension.build_name(), cpu_extension.build_dir()
    other_checkout = tmp_path / "csrc"
    shutil.copytree(cpu_extension.SOURCE_DIR, other_checkout)
    monkeypatch.setattr(cpu_extension, "SOURCE_DIR", other_checkout)
    assert cpu_extension.build_name() == here_name  # the same library ...
    assert cpu_extension.build_dir() != here  # ... built once per checkout
    assert cpu_extension.build_dir().name.startswith(here_name)


def test_a_build_is_announced_before_it_starts(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_extension, "compiler", lambda: "c++")
    logged_before_the_build = []

    def fake_build(**kwargs):
        logged_before_the_build.append("building the C++ CPU kernels into" in caplog.text)
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").touch()

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    cpu_extension.load.cache_clear()
    try:
        with caplog.at_level("INFO", logger="kernels.cpu.extension"):
            assert cpu_extension.load()
            assert logged_before_the_build == [True] and "tens of seconds" in caplog.text
            caplog.clear()
            cpu_extension.load.cache_clear()
            assert cpu_extension.load()  # built already: no announcement
        assert "building" not in caplog.text and "C++ CPU kernels ready" in caplog.text
    finally:
        cpu_extension.load.cache_clear()  # later tests load the real build again
