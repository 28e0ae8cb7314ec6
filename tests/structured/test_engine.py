"""Structured output in the engine on a tiny random Llama: random weights write garbage, but constrained
garbage; every output that finishes (STOP) must satisfy its constraint."""

from __future__ import annotations

import json
import math

import pytest

from engine_core.engine_core import EngineCore
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import EngineCoreRequest, FinishReason, SamplingParams, StructuredOutput
from tests.structured.conftest import tiny_config
from tests.structured.schemas import (
    ARITHMETIC,
    CHOICES,
    PHONE_REGEX,
    SCHEMAS,
    check_json,
    check_lark,
    check_regex,
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_config(tiny_model_dir))


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("Answer in the requested format, please, and keep it short: " * 3, add_special_tokens=False)


def generate(engine, prompt, structured, **kwargs):
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 200, **kwargs}, structured=structured)
    return engine.generate([prompt], params)[0]


def assert_all_free(core: EngineCore) -> None:
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(engine, prompt, tokenizer, name):
    schema = SCHEMAS[name]
    output = generate(engine, prompt, StructuredOutput(json_schema=json.dumps(schema)), n=6, seed=11)
    finished = [c for c in output.completions if c.finish_reason == FinishReason.STOP]
    assert len(finished) >= 3, [c.finish_reason for c in output.completions]
    for completion in finished:
        check_json(tokenizer.decode(completion.token_ids), schema)
    assert_all_free(engine.engine_core)


def test_prefix_cache_hits_keep_outputs_valid(engine, prompt, tokenizer):
    schema = SCHEMAS["order"]
    structured = StructuredOutput(json_schema=json.dumps(schema))
    first = generate(engine, prompt + [7], structured, temperature=0.0)
    again = generate(engine, prompt + [7], structured, temperature=0.0)  # the prompt's full blocks are cached
    assert again.usage.cached_tokens >= 16
    for completion in (*first.completions, *again.completions):
        if completion.finish_reason == FinishReason.STOP:
            check_json(tokenizer.decode(completion.token_ids), schema)


def test_regex_choice_and_lark_grammar(engine, prompt, tokenizer):
    cases = [(StructuredOutput(regex=PHONE_REGEX), check_regex),
             (StructuredOutput(choice=CHOICES), lambda text: text in CHOICES or pytest.fail(text)),
             (StructuredOutput(grammar=ARITHMETIC), check_lark)]
    for structured, check in cases:
        output = generate(engine, prompt, structured, n=4, seed=5, max_tokens=120)
        finished = [c for c in output.completions if c.finish_reason == FinishReason.STOP]
        assert finished, f"no {structured.kind} output finished"
        for completion in finished:
            check(tokenizer.decode(completion.token_ids))


def test_greedy_json_object_and_whitespace_flexible(engine, prompt, tokenizer):
    for structured in (StructuredOutput(json_object=True),
                       StructuredOutput(json_schema=json.dumps(SCHEMAS["order"]), whitespace_flexible=True)):
        completion = generate(engine, prompt, structured, temperature=0.0, max_tokens=60).completions[0]
        text = tokenizer.decode(completion.token_ids)
        if completion.finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: still a prefix of some JSON object
            assert completion.finish_reason == FinishReason.LENGTH and text.startswith("{")


def test_seeded_constrained_sampling_is_reproducible(engine, prompt):
    structured = StructuredOutput(json_schema=json.dumps(SCHEMAS["person"]))
    runs = [[c.token_ids for c in generate(engine, prompt, structured, n=2, seed=42).completions] for _ in range(2)]
    assert runs[0] == runs[1]


def test_min_tokens_and_ignore_eos_cannot_extend_a_finished_structure(engine, prompt, tokenizer):
    output = generate(engine, prompt, StructuredOutput(choice=CHOICES), n=3, seed=1, min_tokens=20, ignore_eos=True)
    for completion in output.completions:
        assert completion.finish_reason == FinishReason.STOP
        assert tokenizer.decode(completion.token_ids) in CHOICES
    # min_tokens holds EOS back while the grammar allows more: 1 to 6 digits, at least 4 tokens of them
    output = generate(engine, prompt, StructuredOutput(regex="[0-9]{1,6}"), n=3, seed=2, min_tokens=4)
    for completion in output.completions:
        text = tokenizer.decode(completion.token_ids)
        check_regex(text, "[0-9]{1,6}")
        assert len(completion.token_ids) >= 4, text


def test_logprobs_are_those_of_the_constrained_distribution(engine, prompt, tokenizer):
    completion = generate(engine, prompt, StructuredOutput(choice=CHOICES), logprobs=20, seed=3).completions[0]
    first = completion.logprobs[0]  # the top 20 hold every allowed first token (prefixes of the options)
    assert first.logprobs[0] > float("-inf")
    allowed = [t for t, lp in zip(first.token_ids[1:], first.logprobs[1:]) if lp > float("-inf")]
    assert 1 < len(allowed) < 20
    assert all(any(option.startswith(tokenizer.decode([t])) for option in CHOICES) for t in allowed)
    assert sum(math.exp(lp) for lp in first.logprobs[1:]) == pytest.approx(1.0, abs=1e-4)


def test_preemption_mid_generation_keeps_outputs_valid(tiny_model_dir, prompt, tokenizer):
    core = EngineCore(tiny_config(tiny_model_dir, num_blocks=34))  # 33 usable blocks of 16: four or five requests
    names = sorted(SCHEMAS) * 3
    for i, name in enumerate(names):
        params = SamplingParams(temperature=0.9, seed=i, max_tokens=150,
                                structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[name])))
        core.add_request(EngineCoreRequest(f"r{i}", prompt + [100 + i] * 40, params))
    tokens = {f"r{i}": [] for i in range(len(names))}
    reasons, preemptions = {}, 0
    while core.has_unfinished_requests():
        step = core.step()
        preemptions += step.scheduler_stats.num_preemptions
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert preemptions > 0
    for i, name in enumerate(names):
        if reasons[f"r{i}"] == FinishReason.STOP:
            check_json(tokenizer.decode(tokens[f"r{i}"]), SCHEMAS[name])
    assert list(reasons.values()).count(FinishReason.STOP) >= len(names) // 2
    assert_all_free(core)


def test_aborts_free_requests_and_matchers(engine, prompt):
    core = engine.engine_core
    structured = StructuredOutput(json_schema=json.dumps(SCHEMAS["person"]))
    for i in range(4):
        core.add_request(EngineCoreRequest(f"abort-{i}", prompt, SamplingParams(max_tokens=100, structured=structured)))
    requests = [core.scheduler.get_request(f"abort-{i}") for i in range(4)]
    assert all(r.grammar is not None for r in requests)
    core.step()
    core.step()
    core.abort_requests([f"abort-{i}" for i in range(4)])
    core.step()
    assert_all_free(core)
    assert all(r.is_finished for r in requests)


def test_grammars_compile_once_per_text(tiny_model_dir, prompt):
    engine = LLMEngine(tiny_config(tiny_model_dir))
    structured = StructuredOutput(json_schema=json.dumps(SCHEMAS["order"]))
    engine.generate([prompt, prompt[:-1]], SamplingParams(max_tokens=5, n=3, structured=structured))
    assert engine.engine_core.structured.num_cached_grammars == 1
    engine.generate([prompt], SamplingParams(max_tokens=5, structured=StructuredOutput(regex="a+")))
    assert engine.engine_core.structured.num_cached_grammars == 2


def test_an_engine_without_a_tokenizer_refuses_structured_requests(tiny_model_dir, prompt):
    core = EngineCore(tiny_config(tiny_model_dir, tokenizer=None))  # the tiny model's folder has no tokenizer.json
    request = EngineCoreRequest("r", prompt, SamplingParams(structured=StructuredOutput(choice=("a", "b"))))
    with pytest.raises(ValueError, match="--tokenizer"):
        core.add_request(request)
    assert_all_free(core)
    core.add_request(EngineCoreRequest("free", prompt, SamplingParams(max_tokens=2)))  # unconstrained ones still run


def test_masks_beside_the_forward_or_after_it_give_the_same_outputs(engine, prompt):
    structured = engine.engine_core.structured
    chosen = structured.overlap  # beside the forward
    params = SamplingParams(temperature=0.9, seed=8, n=3, max_tokens=40,
                            structured=StructuredOutput(json_schema=json.dumps(SCHEMAS["person"])))
    outputs = {}
    try:
        for overlap in (True, False):
            structured.overlap = overlap
            outputs[overlap] = [c.token_ids for c in engine.generate([prompt], params)[0].completions]
    finally:
        structured.overlap = chosen
    assert outputs[True] == outputs[False]
