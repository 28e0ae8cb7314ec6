"""Building the C++ CPU kernels is never required: without a compiler the CPU path is pure torch."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, select_backend
from kernels.fused_ops import select_fused_ops


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "tandem-no-such-compiler")
    cpu_extension.load.cache_clear()
    yield
    cpu_extension.load.cache_clear()  # later tests load the real build again


def test_without_a_compiler_the_cpu_path_is_pure_torch(no_compiler, caplog):
    with caplog.at_level("INFO", logger="kernels.cpu_extension"):
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
