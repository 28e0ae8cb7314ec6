"""The step's token budget (--max-num-batched-tokens): what it resolves to by device when not given,
and that the engine runs and reports the resolved value."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.startup import resolve_scheduler
from services.engine.__main__ import build_parser, config_from_args
from tests.engine_core.tiny_models import write_tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_flag_defaults_to_the_device_choice_and_a_given_budget_stays():
    assert config_from_args(build_parser().parse_args([])).scheduler.max_num_batched_tokens is None
    assert resolve_scheduler(SchedulerConfig(), CPU, 2048).max_num_batched_tokens == 512
    assert resolve_scheduler(SchedulerConfig(), CUDA, 2048).max_num_batched_tokens == 2048
    given = config_from_args(build_parser().parse_args(["--max-num-batched-tokens", "96"])).scheduler
    assert resolve_scheduler(given, CPU, 2048).max_num_batched_tokens == 96


def test_without_chunked_prefill_the_default_budget_holds_a_whole_prompt(tmp_path):
    unchunked = SchedulerConfig(enable_chunked_prefill=False)
    assert resolve_scheduler(unchunked, CPU, 4096).max_num_batched_tokens == 4096
    assert resolve_scheduler(unchunked, CPU, 256).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    # a budget given too small for that is still the user's mistake, named by the scheduler
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        EngineCore(EngineConfig(model=ModelConfig(model=str(write_tiny_model(tmp_path)), max_model_len=128),
                                scheduler=SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False),
                                cache=CacheConfig(num_blocks=64)))


def test_the_engine_runs_with_the_resolved_budget(tmp_path):
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(write_tiny_model(tmp_path)), dtype="float32"),
                                     cache=CacheConfig(num_blocks=64)))
    assert engine.config.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    assert engine.scheduler.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]

