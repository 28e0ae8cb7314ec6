"""How speculative decoding is turned on and off: the engine's flags, vLLM's speculative_config, the per-request
switch on the wire and in the CLI, and the combinations refused at start-up."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import SpeculativeConfig
from engine_core.engine_args import EngineArgs
from engine_core.protocol import SamplingParams
from engine_core.startup import resolve_overlap, speculator
from services.sampling_convert import sampling_params_from_proto, sampling_params_to_proto


def test_engine_flags_make_the_config():
    from services.engine.__main__ import build_parser, config_from_args

    parser = build_parser()
    assert not config_from_args(parser.parse_args([])).speculative.enabled
    spec = config_from_args(parser.parse_args([
        "--speculative-method", "ngram", "--num-speculative-tokens", "6", "--prompt-lookup-min", "3",
        "--prompt-lookup-max", "7", "--speculative-max-batch", "2"])).speculative
    assert spec == SpeculativeConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=3,
                                     prompt_lookup_max=7, max_batch=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        config_from_args(parser.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "0"]))


def test_vllms_speculative_config_dict():
    config = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 2}).create_engine_config()
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=4)
    assert not EngineArgs().create_engine_config().speculative.enabled
    with pytest.raises(ValueError, match="unknown keys \\['draft_tensor_parallel_size'\\]"):
        EngineArgs(speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1}).create_engine_config()


def test_start_up_refuses_overlap_on_and_a_missing_draft_model():
    from services.engine.__main__ import build_parser, config_from_args

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="draft model 'nowhere' not found"):
        config_from_args(build_parser().parse_args(["--speculative-method", "draft", "--draft-model", "nowhere"]))
    with pytest.raises(ValueError, match="speculative method 'draft' takes a draft_model"):
        SpeculativeConfig(method="draft")
    ngram = SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match="overlap 'on' cannot be combined with speculative decoding"):
        resolve_overlap("on", cpu, ngram)
    assert not resolve_overlap("auto", cuda, ngram) and resolve_overlap("auto", cuda, SpeculativeConfig())
    assert speculator(SpeculativeConfig(), cpu) is None
    assert speculator(ngram, cpu).max_batch == 4 and speculator(ngram, cuda).max_batch == 32
    assert speculator(SpeculativeConfig(method="ngram", max_batch=9), cpu).max_batch == 9


def test_the_per_request_switch_crosses_the_wire():
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).speculative
    off = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(speculative=False)))
    assert off.speculative is False


def test_the_cli_and_the_python_client_send_it():
    import argparse

    from clients.cli.options import sampling_from_args, sampling_parent
    from clients.generation import sampling_params

    parser = argparse.ArgumentParser(parents=[sampling_parent()])
    assert sampling_from_args(parser.parse_args(["--no-speculative"]))["speculative"] is False
    assert "speculative" not in sampling_from_args(parser.parse_args([]))
    proto = sampling_params(temperature=0, speculative=False)
    assert proto.HasField("speculative") and not proto.speculative
    assert not sampling_params(temperature=0).HasField("speculative")
