"""Structured output on an engine that speculates: constrained requests decode without drafts (their grammar would
have to accept each draft and roll back the rejected ones: not built), and their outputs are unchanged."""

from __future__ import annotations

import json
from dataclasses import replace

from engine_core.config import SpeculativeConfig
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import FinishReason, SamplingParams, StructuredOutput
from tests.structured.conftest import tiny_config
from tests.structured.schemas import SCHEMAS, check_json


def test_constrained_requests_do_not_speculate_and_keep_their_output(tiny_model_dir, tokenizer):
    prompt = tokenizer.encode("Answer in JSON, please: " * 3, add_special_tokens=False)
    schema = SCHEMAS["order"]
    constrained = SamplingParams(temperature=0.0, max_tokens=120,
                                 structured=StructuredOutput(json_schema=json.dumps(schema)))
    outputs = []
    for spec in (SpeculativeConfig(), SpeculativeConfig(method="ngram", num_speculative_tokens=3)):
        engine = LLMEngine(replace(tiny_config(tiny_model_dir), speculative=spec))
        core = engine.engine_core
        engine.add_request("json", prompt, constrained)
        result = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                result = output.completions[0]
            assert core.scheduler.spec_decode_stats.num_drafts == 0
            assert not any(request.spec_token_ids for request in core.scheduler.requests.values())
        outputs.append(result.token_ids)
        if result.finish_reason == FinishReason.STOP:
            check_json(tokenizer.decode(result.token_ids), schema)
        assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
    assert outputs[0] == outputs[1] and len(outputs[0]) > 5


def test_a_stop_string_inside_a_multi_token_step_ends_the_tokens_too(tiny_model_dir, tokenizer):
    """With the model as its own draft every step emits k + 1 tokens; the offline engine's detokenizer (the
    frontend's, engine_core/text/detokenizer.py) cuts both the text and the token ids at the stop string."""
    prompt = tokenizer.encode("Tell me something: " * 3, add_special_tokens=False)
    engines = {spec.enabled: LLMEngine(replace(tiny_config(tiny_model_dir), speculative=spec)) for spec in (
        SpeculativeConfig(), SpeculativeConfig(method="draft", draft_model=str(tiny_model_dir)))}
    free = engines[False].generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = free.completions[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=1)
    off, on = (engines[spec].generate([prompt], params)[0].completions[0] for spec in (False, True))
    assert (on.text, on.token_ids, on.finish_reason, on.stop_string) == (
        off.text, off.token_ids, FinishReason.STOP, stop)
    assert len(on.token_ids) < 30 and len(on.logprobs) == len(on.token_ids)
