"""Structured output's pieces on their own: the shared check, the wire conversion, the caps, the
bitmask, min_tokens under a grammar, and the Python client's keywords."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clients import generation
from engine_core.protocol import SamplingParams, StructuredOutput, validate_sampling_params
from engine_core.protocol.structured_output import grammar_text
from engine_core.request import Request
from engine_core.structured.bitmask import apply_token_mask
from engine_core.structured.masks import _ban_ends, disallowed_tokens
from services import sampling_convert
from services.frontend.limits import RequestLimits
from tests.structured.schemas import ARITHMETIC, PERSON


def refused(structured: StructuredOutput) -> str:
    with pytest.raises(ValueError) as info:
        validate_sampling_params(SamplingParams(structured=structured))
    return str(info.value)


# ---- the one check, where a request enters ----------------------------------------------------------
@pytest.mark.parametrize("structured, message", [
    (StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"type": "no-such-type"}}}'),
     "structured.json_schema does not compile: "),
    (StructuredOutput(json_schema='{"type": "object",'), "structured.json_schema is not valid JSON"),
    (StructuredOutput(json_schema="[1, 2]"), "structured.json_schema must be a JSON object"),
    (StructuredOutput(regex="a(b"), "structured.regex does not compile: "),
    (StructuredOutput(grammar="start: missing_rule"), "structured.grammar does not compile: "),
    (StructuredOutput(choice=()), "structured.choice.options is empty"),
    (StructuredOutput(choice=("yes", "")), "structured.choice.options[1] must be a non-empty string"),
    (StructuredOutput(json_schema="{}", regex="a"), "structured sets json_schema and regex: set exactly one"),
    (StructuredOutput(whitespace_flexible=True), "structured sets no constraint"),
])
def test_bad_constraints_are_refused_naming_the_field(structured, message):
    assert refused(structured).startswith(message)


def test_the_compilers_message_is_passed_on():
    assert "unclosed group" in refused(StructuredOutput(regex="a(b"))
    assert "missing_rule" in refused(StructuredOutput(grammar="start: missing_rule"))


def test_good_constraints_pass_and_choose_their_grammar():
    for structured in (StructuredOutput(json_schema=json.dumps(PERSON)), StructuredOutput(json_object=True),
                       StructuredOutput(regex="[a-z]+"), StructuredOutput(choice=["a", 'b"c']),
                       StructuredOutput(grammar=ARITHMETIC)):
        assert validate_sampling_params(SamplingParams(structured=structured)).structured == structured
    compact = grammar_text(StructuredOutput(json_object=True))
    assert compact != grammar_text(StructuredOutput(json_object=True, whitespace_flexible=True))


# ---- the wire -----------------------------------------------------------------------------------
def test_proto_round_trip_and_the_empty_oneof():
    from tandem.v1 import common_pb2

    for structured in (StructuredOutput(json_schema="{}", whitespace_flexible=True), StructuredOutput(json_object=True),
                       StructuredOutput(regex="x"), StructuredOutput(choice=("a", "b")), StructuredOutput(grammar="g")):
        proto = sampling_convert.sampling_params_to_proto(SamplingParams(structured=structured))
        assert sampling_convert.sampling_params_from_proto(proto).structured == structured
    for empty in (common_pb2.StructuredOutput(), common_pb2.StructuredOutput(json_object=False)):
        params = sampling_convert.sampling_params_from_proto(common_pb2.SamplingParams(structured=empty))
        assert params.structured is None  # no constraint
    choice = common_pb2.StructuredOutput(choice=common_pb2.Choice())
    params = sampling_convert.sampling_params_from_proto(common_pb2.SamplingParams(structured=choice))
    assert params.structured == StructuredOutput(choice=())  # refused by validation, by name


# ---- the caps -----------------------------------------------------------------------------------
@pytest.mark.parametrize("structured, flag", [
    (StructuredOutput(json_schema=json.dumps({"description": "x" * 200})), "--max-schema-bytes"),
    (StructuredOutput(grammar="start: " + '"a" ' * 60), "--max-schema-bytes"),
    (StructuredOutput(regex="a" * 11), "--max-regex-length"),
    (StructuredOutput(choice=tuple(str(i) for i in range(4))), "--max-choices"),
    (StructuredOutput(choice=("x" * 101, "y" * 100)), "--max-schema-bytes"),
])
def test_caps(structured, flag):
    limits = RequestLimits(max_schema_bytes=200, max_regex_chars=10, max_choices=3)
    with pytest.raises(ValueError, match=flag):
        limits.check_sampling(SamplingParams(structured=structured))
    RequestLimits().check_sampling(SamplingParams(structured=structured))  # the defaults are larger


# ---- masks --------------------------------------------------------------------------------------
def bitmask_allowing(vocab_size: int, *allowed: int) -> np.ndarray:
    bits = np.zeros(((vocab_size + 31) // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)[None, :].copy()


def test_bitmask_sets_disallowed_logits_to_minus_infinity():
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = np.concatenate([bitmask_allowing(70, 5), bitmask_allowing(70, 0, 31, 32, 69)])
    apply_token_mask(logits, disallowed_tokens(bitmask, 70), [0, 2])
    assert torch.equal(logits[1], before[1])  # an unconstrained row
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.equal(logits[2, [0, 31, 32, 69]], before[2, [0, 31, 32, 69]])
    every_row = torch.zeros(2, 70)
    apply_token_mask(every_row, disallowed_tokens(bitmask, 70), [0, 1])
    assert torch.isfinite(every_row).nonzero().tolist() == [[0, 5], [1, 0], [1, 31], [1, 32], [1, 69]]


def test_min_tokens_bans_ends_unless_nothing_else_is_allowed():
    request = Request("r", [1, 2], SamplingParams(min_tokens=3, stop_token_ids=(40,)), block_size=16,
                      eos_token_ids=frozenset({2, 33}))
    row = bitmask_allowing(64, 2, 33, 40, 7)[0]
    _ban_ends(row, request)
    assert np.array_equal(row, bitmask_allowing(64, 7)[0])
    only_ends = bitmask_allowing(64, 2, 33)[0]
    _ban_ends(only_ends, request)  # the structure is complete: EOS stays allowed
    assert np.array_equal(only_ends, bitmask_allowing(64, 2, 33)[0])


# ---- the Python client --------------------------------------------------------------------------
def test_client_keywords_build_one_constraint():
    params = generation.sampling_params(json_schema=PERSON, whitespace_flexible=True, max_tokens=8)
    assert json.loads(params.structured.json_schema) == PERSON and params.structured.whitespace_flexible
    assert list(generation.sampling_params(choice=["a", "b"]).structured.choice.options) == ["a", "b"]
    assert generation.sampling_params(json_object=True).structured.json_object
    with pytest.raises(ValueError, match="give exactly one of"):
        generation.sampling_params(regex="a", choice=["b"])
    with pytest.raises(TypeError, match="choice must be a list of strings"):
        generation.sampling_params(choice="ab")
    with pytest.raises(TypeError, match="did you mean 'json_schema'"):
        generation.sampling_params(json_shema="{}")
