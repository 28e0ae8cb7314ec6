"""--kv-cache-dtype int8 on the real SmolLM2 (bf16), against its own bf16 cache (issue 53's accuracy bars):
the slow tier's greedy chat answers unchanged, and over 480 tokens of the quality benchmark's text, teacher-
forced, the perplexity within 1 % and the top token the same at 98 % of the positions or more.

The int8 engine runs the bf16 engine's linear plans (pinned), so the KV cache is all that differs between
them; each chat runs alone, so the batch is the same too. The full figures, prefill and decode over 2,040
predictions: `python scripts/bench_quality.py --kv-cache-dtype int8` (docs/kv-cache-dtype.md#accuracy).
"""

from __future__ import annotations

import math

import pytest

from engine_core import LLM, SamplingParams
from engine_core.config import CacheConfig, EngineConfig, ModelConfig
from engine_core.loader import default_model_path
from scripts.bench_kv_dtype import plan_pins
from scripts.bench_quality import text_token_ids
from tests.test_batch_invariance_smollm2 import OTHERS, QUESTION

pytestmark = pytest.mark.slow  # loads the real SmolLM2 (make test-slow)

SCORED = 480


@pytest.fixture(scope="module")
def engines():
    bf16 = LLM(config=EngineConfig(model=ModelConfig(dtype="bfloat16", max_model_len=1024),
                                   cache=CacheConfig(kv_cache_dtype="bf16")))
    pins = plan_pins(bf16.llm_engine) or None
    int8 = LLM(config=EngineConfig(model=ModelConfig(dtype="bfloat16", max_model_len=1024, linear_kernels=pins),
                                   cache=CacheConfig(kv_cache_dtype="int8")))
    assert int8.llm_engine.info.kv_cache_dtype == "int8"
    return {"bf16": bf16, "int8": int8}


def test_the_greedy_chat_answers_are_unchanged(engines):
    params = SamplingParams(temperature=0, max_tokens=40)
    for chat in [QUESTION, *OTHERS]:
        answers = {kv: llm.chat([chat], params)[0].outputs[0].text for kv, llm in engines.items()}
        assert answers["int8"] == answers["bf16"], (chat, answers)
    assert "Paris" in engines["int8"].chat([QUESTION], params)[0].outputs[0].text


def test_teacher_forced_text_keeps_perplexity_and_top_tokens(engines):
    chunk = text_token_ids(default_model_path())[0][0][: SCORED + 1]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    scored = {}
    for kv, llm in engines.items():
        positions = llm.generate([{"prompt_token_ids": chunk}], params)[0].prompt_logprobs  # entry i: token i + 1
        # each entry: the text's token first, then the top one (the same token when it is the top)
        scored[kv] = [(p.logprobs[0], p.token_ids[0] if p.rank == 1 else p.token_ids[1]) for p in positions]
    assert len(scored["int8"]) == SCORED
    perplexity = {kv: math.exp(-sum(lp for lp, _ in s) / SCORED) for kv, s in scored.items()}
    agree = sum(a[1] == b[1] for a, b in zip(scored["int8"], scored["bf16"])) / SCORED
    assert abs(perplexity["int8"] / perplexity["bf16"] - 1) < 0.01 and agree >= 0.98, (perplexity, agree)
