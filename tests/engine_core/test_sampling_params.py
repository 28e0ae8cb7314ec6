"""Every invalid sampling field gets a ValueError (from the one validator) that names the field and the range."""

import math

import pytest

from engine_core.protocol import OutputKind, SamplingParams, validate_sampling_params

INVALID = [
    ({"n": 0}, "n must be >= 1"),
    ({"n": 1.5}, "n must be an integer"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": math.nan}, "temperature must be >= 0"),
    ({"temperature": math.inf}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be -1 or 0 (off) or a positive integer"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"min_p": 1.1}, "min_p must be in [0, 1]"),
    ({"seed": "abc"}, "seed must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids[1] must be a token id >= 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2]"),
    ({"logit_bias": {-5: 1.0}}, "logit_bias key must be a token id >= 0"),
    ({"logit_bias": {5: 101.0}}, "logit_bias[5] must be in [-100, 100]"),
    ({"logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"logprobs": -1}, "logprobs must be in [0, 20]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
    ({"stop": ["ok", ""]}, "stop[1] is empty"),
    ({"output_kind": 7}, "output_kind must be one of"),
]


@pytest.mark.parametrize("kwargs, message", INVALID, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(INVALID)])
def test_invalid_field_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        validate_sampling_params(SamplingParams(**kwargs))
    assert message in str(excinfo.value)
    assert "got" in str(excinfo.value)


def test_defaults_and_normalisation():
    params = SamplingParams(top_k=-1, stop="###", output_kind=1, logit_bias={"7": 2})
    assert params.top_k == 0
    assert params.stop == ("###",)
    assert params.output_kind is OutputKind.DELTA
    assert params.logit_bias == {7: 2.0}
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
