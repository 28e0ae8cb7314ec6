"""Generation through the real frontend server and the fake engine: output kinds, n > 1, logprobs, usage, chat."""

from __future__ import annotations

import uuid

import pytest
from tandem.v1 import common_pb2, generation_pb2

from services.frontend.chat.template import render_chat

DELTA, CUMULATIVE, FINAL_ONLY = (common_pb2.OUTPUT_KIND_DELTA, common_pb2.OUTPUT_KIND_CUMULATIVE,
                                 common_pb2.OUTPUT_KIND_FINAL_ONLY)
PROMPT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 你好"


async def collect(stack, request, rpc="Generate"):
    return [r async for r in getattr(stack.stub, rpc)(request)]


def texts_by_index(responses, kind=DELTA) -> dict[int, str]:
    """The final text per completion index, however the stream reported it."""
    texts: dict[int, str] = {}
    for response in responses:
        for c in response.completions:
            texts[c.index] = texts.get(c.index, "") + c.text if kind == DELTA else c.text
    return texts


def request(text=PROMPT, request_id="", **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(request_id=request_id or uuid.uuid4().hex, text=text,
                                          sampling_params=common_pb2.SamplingParams(**sampling))


def test_output_kinds_give_the_same_final_text(stack):
    finals = {}
    for kind in (DELTA, CUMULATIVE, FINAL_ONLY):
        responses = stack.run(collect(stack, request(max_tokens=60, output_kind=kind)))
        finals[kind] = texts_by_index(responses, kind)[0]
        assert responses[-1].completions[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        if kind == FINAL_ONLY:
            assert len(responses) == 1
        if kind == CUMULATIVE:  # every message extends the previous one
            texts = [r.completions[0].text for r in responses]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert finals[DELTA] == finals[CUMULATIVE] == finals[FINAL_ONLY]
    # the fake engine echoes the prompt, repeated
    assert finals[DELTA] == stack.tokenizer.decode((stack.tokenizer.encode(PROMPT) * 3)[:60])


def test_n_completions_are_indexed_and_seeded(stack):
    scripts = {i: stack.tokenizer.encode(f" completion number {i} says hi", add_special_tokens=False) for i in range(3)}
    for i, ids in scripts.items():
        stack.scripts[f"{i}_fanout"] = ids
    responses = stack.run(collect(stack, request(request_id="fanout", n=3, seed=7, max_tokens=50)))
    assert {r.request_id for r in responses} == {"fanout"}
    texts = texts_by_index(responses)
    assert texts == {i: stack.tokenizer.decode(ids) for i, ids in scripts.items()}
    for i in range(3):
        child = stack.engine.added[f"{i}_fanout"].sampling_params
        assert (child.n, child.seed) == (1, 7 + i)
    assert responses[-1].usage.completion_tokens == sum(map(len, scripts.values()))
    finished = [c.index for r in responses for c in r.completions if c.finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_logprobs_carry_decoded_tokens(stack):
    responses = stack.run(collect(stack, request(max_tokens=8, logprobs=2, prompt_logprobs=1)))
    entries = [e for r in responses for c in r.completions for e in c.logprobs]
    token_ids = [t for r in responses for c in r.completions for t in c.token_ids]
    assert len(entries) == len(token_ids) == 8
    for entry, token_id in zip(entries, token_ids):
        assert entry.token_ids[0] == token_id and len(entry.token_ids) == 3 and entry.rank == 1
        assert list(entry.decoded) == [stack.tokenizer.decode([t], skip_special_tokens=False) for t in entry.token_ids]
    prompt_len = responses[0].num_prompt_tokens
    assert len(responses[0].prompt_logprobs) == prompt_len - 1
    assert all(not r.prompt_logprobs for r in responses[1:])


def test_usage_counts_prompt_completion_and_cached_tokens(stack):
    stack.engine.num_cached_tokens = 4
    try:
        responses = stack.run(collect(stack, request(max_tokens=9)))
    finally:
        stack.engine.num_cached_tokens = 0
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        len(stack.tokenizer.encode(PROMPT)), 9, 4)
    assert responses[0].num_prompt_tokens == usage.prompt_tokens
    assert all(not r.HasField("usage") for r in responses[:-1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_eos_ends_with_its_stop_token_id_and_is_not_shown(stack, skip_special_tokens):
    eos = stack.engine.eos_token_id
    body = stack.tokenizer.encode(" the end", add_special_tokens=False)
    stack.scripts["eos"] = [*body, eos, *body]
    responses = stack.run(collect(stack, request(request_id="eos", max_tokens=50,
                                                 skip_special_tokens=skip_special_tokens)))
    last = responses[-1].completions[-1]
    assert (last.finish_reason, last.stop_token_id) == (common_pb2.FINISH_REASON_STOP, eos)
    assert texts_by_index(responses)[0] == " the end"


def test_max_tokens_defaults_to_the_room_left_in_the_context(stack):
    stack.steps["room"] = [64]
    stack.run(collect(stack, request(request_id="room", max_tokens=None)))
    sent = stack.engine.added["room"]
    assert sent.sampling_params.max_tokens == stack.engine.max_model_len - len(sent.prompt_token_ids)
    assert sent.sampling_params.temperature == 1.0 and sent.sampling_params.top_p == 1.0
    assert sent.sampling_params.output_kind == DELTA and sent.sampling_params.skip_special_tokens


def test_max_tokens_up_to_the_room_left_is_kept_and_clamp_max_tokens_cuts_a_larger_one(stack):
    room = stack.engine.max_model_len - len(stack.tokenizer.encode(PROMPT))
    for request_id, sampling in (("exact", {"max_tokens": room}),
                                 ("clamped", {"max_tokens": 2**31 - 1, "clamp_max_tokens": True})):
        stack.steps[request_id] = [64]
        stack.run(collect(stack, request(request_id=request_id, **sampling)))
        assert stack.engine.added[request_id].sampling_params.max_tokens == room, request_id


def test_chat_renders_the_models_template(stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    chat = generation_pb2.ChatRequest(request_id="chat", sampling_params=common_pb2.SamplingParams(max_tokens=4),
                                      messages=[generation_pb2.ChatMessage(**m) for m in messages])
    responses = stack.run(collect(stack, chat, rpc="Chat"))
    tok = stack.tokenizer
    text = render_chat(tok.chat_template, messages, add_generation_prompt=True, bos_token=tok.bos_token,
                       eos_token=tok.eos_token)
    assert list(stack.engine.added["chat"].prompt_token_ids) == tok.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert responses[-1].usage.completion_tokens == 4


def test_token_id_prompt(stack):
    ids = stack.tokenizer.encode("tokens in, tokens out")
    req = generation_pb2.GenerateRequest(request_id="ids", token_ids=generation_pb2.TokenIds(ids=ids),
                                         sampling_params=common_pb2.SamplingParams(max_tokens=len(ids)))
    responses = stack.run(collect(stack, req))
    assert texts_by_index(responses)[0] == stack.tokenizer.decode(ids)


def test_async_llm_takes_a_str_and_vllms_prompt_forms(stack):
    """As vLLM's AsyncLLM.generate: a str, token ids or a prompt dict; vLLM's names on the output."""
    from engine_core.protocol import SamplingParams
    from services.frontend.errors import InvalidRequest

    async def final(prompt):
        text, last = "", None
        async for output in stack.llm.generate(prompt, SamplingParams(max_tokens=8), uuid.uuid4().hex):
            text, last = text + output.outputs[0].text, output
        return text, last

    ids = stack.tokenizer.encode(PROMPT)
    answers = [stack.run(final(p)) for p in (PROMPT, ids, {"prompt": PROMPT}, {"prompt_token_ids": ids})]
    assert len({text for text, _ in answers}) == 1 and answers[0][0]
    text, last = answers[0]
    assert last.finished and last.prompt == PROMPT and last.prompt_token_ids == ids
    assert last.metrics.num_generation_tokens == 8 and last.outputs is last.completions
    with pytest.raises(InvalidRequest, match="prompt is missing or not understood"):
        stack.run(final(3.5))
