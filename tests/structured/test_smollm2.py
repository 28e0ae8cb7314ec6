"""Structured output on the embedded SmolLM2 (a real model: it should fill the structures sensibly and
finish them); every output must satisfy its constraint."""

from __future__ import annotations

import json

import pytest

from engine_core.config import EngineConfig, ModelConfig
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import FinishReason, SamplingParams, StructuredOutput
from services.frontend.chat.template import render_chat
from tests.structured.schemas import ARITHMETIC, PHONE_REGEX, SCHEMAS, check_json, check_lark, check_regex

pytestmark = pytest.mark.slow  # loads the real SmolLM2 (make test-slow)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=ModelConfig(max_model_len=1024)))


def ask(engine, tokenizer, question: str, structured: StructuredOutput, **kwargs):
    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": question}],
                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 200, **kwargs}, structured=structured)
    output = engine.generate([tokenizer.encode(text, add_special_tokens=False)], params)[0]
    return [(tokenizer.decode(c.token_ids), c.finish_reason) for c in output.completions]


@pytest.mark.parametrize("name, question", [
    ("person", "Describe a software engineer called Ada who lives in Paris, as JSON."),
    ("measurements", "Give two sensor readings as JSON."),
    ("order", "Write an order of two items as JSON."),
])
def test_json_schemas_greedy_and_sampled(engine, tokenizer, name, question):
    structured = StructuredOutput(json_schema=json.dumps(SCHEMAS[name]))
    results = ask(engine, tokenizer, question, structured) + ask(engine, tokenizer, question, structured,
                                                                  temperature=0.8, seed=1, n=3)
    for text, reason in results:
        assert reason == FinishReason.STOP, text
        check_json(text, SCHEMAS[name])


def test_regex_choice_and_grammar(engine, tokenizer):
    [(phone, reason)] = ask(engine, tokenizer, "Write a US phone number.", StructuredOutput(regex=PHONE_REGEX))
    assert reason == FinishReason.STOP
    check_regex(phone)
    [(answer, reason)] = ask(engine, tokenizer, "Is Paris the capital of France? Answer yes or no.",
                             StructuredOutput(choice=("yes", "no")))
    assert reason == FinishReason.STOP and answer in ("yes", "no")
    for text, reason in ask(engine, tokenizer, "Write a sum of three small numbers.",
                            StructuredOutput(grammar=ARITHMETIC), temperature=0.7, seed=3, n=2, max_tokens=60):
        if reason == FinishReason.STOP:
            check_lark(text)
