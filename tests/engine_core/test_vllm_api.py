"""The offline API under vLLM's names (LLM, LLMEngine, RequestOutput.outputs[i].text, ...), on a tiny random Llama
with SmolLM2's vocabulary and tokenizer: text prompts, filled text, stop strings, output kinds, chat."""

from __future__ import annotations

import pytest

from engine_core import LLM, EngineArgs, LLMEngine, OutputKind, SamplingParams
from engine_core.config import EngineConfig, ModelConfig
from engine_core.loader import default_model_path
from engine_core.protocol import FinishReason
from engine_core.text.chat_template import render_chat
from tests.engine_core.tiny_models import write_tiny_model

VOCAB = 49152  # SmolLM2's, so its tokenizer fits
PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def engine_args(tmp_path_factory) -> EngineArgs:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-vllm-api"), vocab_size=VOCAB, max_position_embeddings=256)
    return EngineArgs(model=str(folder), tokenizer=str(default_model_path()), dtype="float32", max_model_len=256,
                      max_num_seqs=16, device="cpu")


@pytest.fixture(scope="module")
def llm(engine_args) -> LLM:
    return LLM(**vars(engine_args))


def greedy(**kwargs) -> SamplingParams:
    """Greedy unless told otherwise; 16 tokens, EOS ignored (the random model may pick it early)."""
    return SamplingParams(**{"temperature": 0, "max_tokens": 16, "ignore_eos": True, **kwargs})


def test_generate_fills_vllm_fields_and_text_as_the_tokenizer_decodes(llm):
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, greedy(logprobs=1))
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        assert output.finished and output.prompt == prompt
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert completion.text == tokenizer.decode(completion.token_ids) and len(completion.token_ids) == 16
        assert completion.finish_reason == FinishReason.LENGTH and str(completion.finish_reason) == "length"
        assert completion.stop_reason is None and completion.finished()
        assert completion.cumulative_logprob == pytest.approx(sum(e.logprobs[0] for e in completion.logprobs))
        assert output.metrics.num_generation_tokens == 16 and output.metrics.first_token_latency > 0
        assert output.completions is output.outputs  # Tandem's earlier name still works


def test_every_prompt_form_gives_the_same_tokens(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[0])
    forms = [PROMPTS[0], [PROMPTS[0]], ids, [ids], {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}]
    answers = {tuple(llm.generate(form, greedy(max_tokens=6))[0].outputs[0].token_ids) for form in forms}
    assert len(answers) == 1


def test_a_stop_string_ends_the_text_and_the_request(llm):
    whole = llm.generate(PROMPTS[0], greedy(max_tokens=24))[0].outputs[0]
    stop = whole.text[len(whole.text) // 2:len(whole.text) // 2 + 2]  # two characters from the middle
    cut = llm.generate(PROMPTS[0], greedy(max_tokens=24, stop=[stop]))[0].outputs[0]
    assert cut.text == whole.text[:whole.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == (FinishReason.STOP, stop)
    assert len(cut.token_ids) < 24 and cut.token_ids == whole.token_ids[:len(cut.token_ids)]
    kept = llm.generate(PROMPTS[0], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == whole.text[:whole.text.index(stop) + len(stop)]
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine.engine_core.has_unfinished_requests()


def test_the_engine_step_loop_takes_text_and_is_cumulative_by_default(llm, engine_args):
    engine = LLMEngine.from_engine_args(engine_args)
    engine.add_request("0", PROMPTS[1], greedy(n=2, temperature=0.8, seed=1))
    texts: dict[int, list[str]] = {0: [], 1: []}
    finished = []
    while engine.has_unfinished_requests():
        for request_output in engine.step():
            for completion in request_output.outputs:
                texts[completion.index].append(completion.text)
            if request_output.finished:
                finished.append(request_output)
    for index, seen in texts.items():
        assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:])), seen  # each whole so far
    final = {c.index: c.text for c in finished[-1].outputs}
    assert [final[i] for i in (0, 1)] == [texts[0][-1], texts[1][-1]]
    whole = llm.generate(PROMPTS[1], greedy(n=2, temperature=0.8, seed=1))[0]
    assert [c.text for c in whole.outputs] == [texts[0][-1], texts[1][-1]]


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.FINAL_ONLY])
def test_other_output_kinds_give_the_same_text(llm, kind):
    engine = llm.llm_engine
    whole = llm.generate(PROMPTS[0], greedy(max_tokens=20, stop=["xq"]))[0].outputs[0].text
    engine.add_request("kind", PROMPTS[0], greedy(max_tokens=20, stop=["xq"], output_kind=kind))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [output.outputs[0].text for output in engine.step()]
    assert "".join(pieces) == whole and (kind == OutputKind.DELTA or len(pieces) == 1)


def test_chat_renders_the_models_own_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, greedy(max_tokens=8))[0]
    expected = render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token,
                           eos_token=tokenizer.eos_token)
    assert output.prompt == expected and "<|im_start|>assistant\n" in expected
    assert output.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids)
    assert len(llm.chat([messages, messages], greedy(max_tokens=4))) == 2


def test_a_model_path_is_a_config():
    assert EngineConfig(model="x.gguf").model == ModelConfig(model="x.gguf")
    assert EngineArgs(model="x.gguf", seed=3).create_engine_config().model.seed == 3
    with pytest.raises(ValueError, match="model must be a ModelConfig or a model path"):
        EngineConfig(model=3)


def test_text_without_a_tokenizer_is_refused_with_what_to_do(engine_args):
    engine = LLMEngine.from_engine_args(EngineArgs(**{**vars(engine_args), "tokenizer": None}))
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer.*give token ids"):
        engine.add_request("text", "Hello", greedy())
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        engine.add_request("stop", [1, 2, 3], greedy(stop=["."]))
    output = engine.generate([[1, 2, 3]], greedy(max_tokens=3))[0].outputs[0]
    assert output.text == "" and len(output.token_ids) == 3
    with pytest.raises(ValueError, match="a prompt is a str, a list of token ids"):
        engine.add_request("bad", 3.5, greedy())
