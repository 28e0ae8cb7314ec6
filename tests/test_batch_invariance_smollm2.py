"""--batch-invariant on the real SmolLM2, as SGLang tests its deterministic inference: one chat question at every
batch size from 1 to 32, mixed batches of chats, and a shared system prompt with the prefix cache hit and missed;
each must give one answer, the same tokens and the same logprobs. The fast tier runs the same tests on a tiny
random model (tests/engine_core/test_batch_invariance.py)."""

from __future__ import annotations

import random

import pytest

from engine_core import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads the real SmolLM2 (make test-slow)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OTHERS = [[{"role": "user", "content": text}] for text in (
    "Write a haiku about the sea.", "What is 17 times 3?", "Name three primary colours.",
    "Explain photosynthesis in one sentence.", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What is the boiling point of water?",
)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=0)


def answer(output) -> tuple:
    completion = output.outputs[0]
    return completion.text, tuple(completion.token_ids), tuple(lp.logprobs[0] for lp in completion.logprobs)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", max_model_len=1024, batch_invariant=True, enable_prefix_caching=False)


def test_the_engine_says_it_runs_batch_invariant(llm):
    assert llm.llm_engine.info.batch_invariant


def test_the_question_gets_one_answer_at_every_batch_size_and_it_names_paris(llm):
    others = [OTHERS[i % len(OTHERS)] for i in range(31)]
    seen = {answer(llm.chat([QUESTION] + others[: size - 1], GREEDY)[0]) for size in range(1, 33)}
    assert len(seen) == 1, f"{len(seen)} different answers over batch sizes 1..32"
    assert "Paris" in next(iter(seen))[0]


def test_mixed_batches_give_each_chat_one_answer(llm):
    chats = [QUESTION, *OTHERS]
    rng = random.Random(0)
    seen: dict[int, set] = {i: set() for i in range(len(chats))}
    for _ in range(5):
        chosen = rng.sample(range(len(chats)), rng.randint(2, len(chats)))
        for i, output in zip(chosen, llm.chat([chats[i] for i in chosen], GREEDY)):
            seen[i].add(answer(output))
    assert all(len(s) <= 1 for s in seen.values()), {i: len(s) for i, s in seen.items() if len(s) > 1}


def test_a_shared_system_prompt_gives_one_answer_with_the_cache_hit_or_missed(llm):
    system = {"role": "system", "content": "You are a terse assistant who answers geography questions. " * 4}
    chats = [[system, {"role": "user", "content": text}] for text in (
        "What is the capital of France?", "What is the capital of Italy?", "What is the capital of Spain?")]
    missed = [answer(llm.chat(chat, GREEDY)[0]) for chat in chats]  # this engine caches no prefix

    cached = LLM(dtype="bfloat16", max_model_len=1024, batch_invariant=True, enable_prefix_caching=True)
    first = cached.chat(chats[0], GREEDY)[0]
    rest = cached.chat(chats[1:], GREEDY)
    assert all(output.num_cached_tokens >= 32 for output in rest), "the system prompt was never a cache hit"
    assert [answer(o) for o in [first, *rest]] == missed
