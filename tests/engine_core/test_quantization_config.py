"""--quantization from the flag to the loader: parsing, validation, and what auto resolves to."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import ModelConfig
from engine_core.startup import resolve_quantization
from services.engine.__main__ import build_parser, config_from_args

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("value", ["auto", "int8", "int4", "none"])
def test_flag_reaches_the_config(value):
    config = config_from_args(build_parser().parse_args(["--quantization", value]))
    assert config.model.quantization == value


def test_default_is_auto_and_bad_values_are_named():
    assert ModelConfig().quantization == "auto"
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "fp8"])


def test_auto_keeps_an_explicit_float32_exact_and_quantization_needs_the_cpu():
    assert resolve_quantization("auto", "float32", CPU) == "none"  # the parity tests' exact path
    assert resolve_quantization("auto", "auto", CPU) == "auto"
    assert resolve_quantization("int4", "float32", CPU) == "int4"  # asked for explicitly
    assert resolve_quantization("auto", "auto", CUDA) == "none"
    for name in ("int8", "int4"):
        with pytest.raises(ValueError, match="CPU only"):
            resolve_quantization(name, "auto", CUDA)
