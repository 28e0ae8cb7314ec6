"""Overlapped steps (engine_core/overlap.py) change no output.

The same requests run through a tiny random Llama (SmolLM2's vocabulary, so structured output has a
tokenizer) with overlap off and on. "On" runs the forwards and samplings on a device queue that sleeps a
random moment before each piece of work, as a GPU's stream would lag the host, so the host really does
schedule, prepare and update while the "device" has not finished: greedy and seeded outputs,
stops, aborts, structured output, preemption and n > 1 must come out the same.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.loader import default_model_path
from engine_core.offline.llm_engine import LLMEngine
from engine_core.overlap import ThreadQueue
from engine_core.protocol import EngineCoreRequest, FinishReason, SamplingParams, StructuredOutput
from engine_core.startup import resolve_overlap
from tests.engine_core.tiny_models import write_tiny_model

VOCAB = 49152  # SmolLM2's: its tokenizer compiles the grammars
BLOCK_SIZE = 16


class LaggingQueue(ThreadQueue):
    """A device stream that starts each piece of work a random moment late (0-3 ms, seeded)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._random = random.Random(seed)

    def submit(self, fn, *args):  # noqa: ANN001, ANN002, ANN201
        delay = self._random.uniform(0.0, 0.003)

        def late():  # noqa: ANN202
            time.sleep(delay)
            return fn(*args)
        return super().submit(late)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-overlap"), vocab_size=VOCAB, max_position_embeddings=512)


def make_config(folder, overlap: str, *, num_blocks: int = 400, budget: int = 512, max_model_len: int = 512,
                device: str = "cpu") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=max_model_len,
                          tokenizer=str(default_model_path())),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=32),
        device=DeviceConfig(device=device, attention_backend="torch" if device == "cpu" else "auto", overlap=overlap),
    )


def lagging(core: EngineCore, seed: int = 0) -> EngineCore:
    """On CPU, swap the overlapped engine's device queue for a lagging one (CUDA lags by itself)."""
    if core.overlapped is not None and core.runner.device.type == "cpu":
        core.overlapped.queue.close()
        core.overlapped.queue = LaggingQueue(seed)
    return core


def make_engine(folder, overlap: str, **options) -> EngineCore:
    return lagging(EngineCore(make_config(folder, overlap, **options)))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(rng.randrange(5, 70))] for _ in range(count)]


def run(core: EngineCore, requests: list[EngineCoreRequest], abort_after: dict[str, int] | None = None,
        ) -> tuple[dict, int]:
    """Step to the end; request id -> (tokens, finish reason, stop reason), and the preemptions.
    `abort_after`: abort a request once that many of its tokens came out. Also checks that no output
    follows an abort and that no KV block leaks."""
    abort_after = abort_after or {}
    for request in requests:
        core.add_request(request)
    results = {r.request_id: ([], None, None) for r in requests}
    aborted: set[str] = set()
    preemptions = 0
    while core.has_unfinished_requests():
        step = core.step()
        preemptions += step.scheduler_stats.num_preemptions
        for output in step.outputs:
            assert output.request_id not in aborted, f"{output.request_id} sent output after its abort"
            tokens, _, _ = results[output.request_id]
            tokens.extend(output.new_token_ids)
            results[output.request_id] = (tokens, output.finish_reason, output.stop_token_id)
            limit = abort_after.get(output.request_id)
            if limit is not None and len(tokens) >= limit and not output.finished:
                core.abort_requests([output.request_id])
                aborted.add(output.request_id)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1, "KV blocks leaked"
    return results, preemptions


def mixed_requests() -> list[EngineCoreRequest]:
    """Greedy requests of many lengths: stop tokens, min_tokens, ignore_eos, repeated prompts (n > 1's shape)."""
    rng = random.Random(1)
    requests = []
    for i, prompt in enumerate(prompts(14)):
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 60), ignore_eos=i % 3 == 0,
                                min_tokens=rng.choice([0, 0, 5]), stop_token_ids=[rng.randrange(100, VOCAB)])
        requests.append(EngineCoreRequest(f"r{i}", prompt, params))
    shared = prompts(1, seed=9)[0]
    same = SamplingParams(temperature=0.0, max_tokens=30)
    requests += [EngineCoreRequest(f"same{i}", shared, same) for i in range(3)]
    return requests


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_greedy_outputs_identical_with_stops_chunked_prefill_and_preemption(tiny_model_dir, device):
    # 16 usable blocks for 17 requests of up to ~130 tokens and a 32-token budget: chunks and preemptions
    small = {"num_blocks": 17, "budget": 32, "max_model_len": 256, "device": device}
    off, _ = run(make_engine(tiny_model_dir, "off", **small), mixed_requests())
    # stop on a token each request really produces, so the stop path runs
    stop_at = {rid: tokens[len(tokens) // 2] for rid, (tokens, _, _) in off.items() if tokens}
    requests = [
        EngineCoreRequest(r.request_id, r.prompt_token_ids,
                          SamplingParams(**{**vars(r.sampling_params), "stop_token_ids": [stop_at[r.request_id]]}))
        if r.request_id in stop_at and r.request_id.startswith("r") and int(r.request_id[1:]) % 2 else r
        for r in mixed_requests()
    ]
    off, preempted_off = run(make_engine(tiny_model_dir, "off", **small), requests)
    on, preempted_on = run(make_engine(tiny_model_dir, "on", **small), requests)
    assert preempted_off > 0 and preempted_on > 0, "the cache was meant to be too small"
    assert on == off
    assert any(reason == FinishReason.STOP and stop is not None for _, reason, stop in on.values())
    assert any(reason == FinishReason.LENGTH for _, reason, _ in on.values())


def test_aborts_end_streams_at_the_same_place(tiny_model_dir):
    requests = [EngineCoreRequest(f"a{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
                for i, prompt in enumerate(prompts(6, seed=3))]
    full, _ = run(make_engine(tiny_model_dir, "off"), requests)
    abort_after = {"a0": 1, "a2": 7, "a4": 20}
    on, _ = run(make_engine(tiny_model_dir, "on"), requests, abort_after)
    for request_id, (tokens, reason, _) in on.items():
        expected = full[request_id][0]
        if request_id in abort_after:  # a prefix of the full answer, ended by the abort
            assert tokens == expected[:abort_after[request_id]] and reason is None
        else:
            assert tokens == expected and reason == FinishReason.LENGTH


def test_seeded_sampling_n_and_logprobs_identical(tiny_model_dir):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=7, max_tokens=25, logprobs=2, prompt_logprobs=1,
                            presence_penalty=0.5)
    results = {}
    for overlap in ("off", "on"):
        engine = LLMEngine(make_config(tiny_model_dir, overlap))
        lagging(engine.engine_core, seed=5)
        results[overlap] = engine.generate(prompts(3, seed=4), params)
    for off, on in zip(results["off"], results["on"]):
        assert [c.token_ids for c in on.completions] == [c.token_ids for c in off.completions]
        assert len({tuple(c.token_ids) for c in on.completions}) > 1, "seeded children should differ"
        for c_off, c_on in zip(off.completions, on.completions):
            assert [lp.token_ids for lp in c_on.logprobs] == [lp.token_ids for lp in c_off.logprobs]
            for a, b in zip(c_on.logprobs, c_off.logprobs):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert len(on.prompt_logprobs) == len(off.prompt_logprobs)


@pytest.mark.parametrize("constraint", [
    StructuredOutput(json_schema=json.dumps({
        "type": "object", "required": ["name", "age"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "maximum": 99}}})),
    StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,5}"),
    StructuredOutput(choice=("yes", "no", "maybe")),
])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_structured_output_identical(tiny_model_dir, constraint, device):
    requests = [EngineCoreRequest(f"s{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=2,
                                                                   structured=constraint))
                for i, prompt in enumerate(prompts(5, seed=6))]
    requests.append(EngineCoreRequest("free", prompts(1, seed=8)[0], SamplingParams(temperature=0.0, max_tokens=20)))
    off, _ = run(make_engine(tiny_model_dir, "off", device=device), requests)
    on, _ = run(make_engine(tiny_model_dir, "on", device=device), requests)
    assert on == off
    assert any(reason == FinishReason.STOP for _, reason, _ in list(on.values())[:-1] if reason is not None)


def test_auto_turns_overlap_on_for_gpus_only_and_the_flag_parses():
    from services.engine.__main__ import build_parser, config_from_args

    assert resolve_overlap("auto", torch.device("cuda")) and not resolve_overlap("auto", torch.device("cpu"))
    assert resolve_overlap("on", torch.device("cpu")) and not resolve_overlap("off", torch.device("cuda"))
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).device.overlap == "auto"
    assert config_from_args(parser.parse_args(["--overlap", "on"])).device.overlap == "on"
    with pytest.raises(ValueError, match="overlap must be one of"):
        DeviceConfig(overlap="sometimes")


def test_sleep_right_after_the_last_output_waits_for_the_step_in_flight(tiny_model_dir):
    prompt = prompts(1)[0]
    free, _ = run(make_engine(tiny_model_dir, "off", num_blocks=40, max_model_len=256),
                  [EngineCoreRequest("free", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))])
    stop = free["free"][0][3]  # a stop token the scheduler cannot see coming: the next step is already queued
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    core = make_engine(tiny_model_dir, "on", num_blocks=40, max_model_len=256)
    core.add_request(EngineCoreRequest("x", prompt, params))
    first, finished = [], False
    while not finished:
        for output in core.step().outputs:
            first += output.new_token_ids
            finished = output.finished
    assert core.overlapped.in_flight and not core.scheduler.has_unfinished_requests()
    core.sleep()  # no ValueError: the step in flight ran finished requests only
    assert core.asleep and not core.has_unfinished_requests()
    core.wake_up()
    again, _ = run(core, [EngineCoreRequest("y", prompt, params)])
    assert again["y"][0] == first == free["free"][0][:first.index(stop) + 1]


def test_stop_strings_and_n_through_the_frontend_are_unchanged(tiny_model_dir):
    """AsyncLLM over the in-process busy loop: stop strings end a stream by aborting it in the engine, n > 1
    fans out into seeded children; the texts, finish reasons and stop strings must not move with overlap."""
    from engine_core.text.tokenizer import load_tokenizer
    from services.engine.busy_loop import EngineBusyLoop
    from services.frontend.input_processor import TokensPrompt
    from tests.frontend.test_in_process import run_with_llm, token_ids

    tokenizer = load_tokenizer(default_model_path())
    prompt = prompts(1, seed=11)[0]
    greedy = {"temperature": 0.0, "ignore_eos": True}

    async def body(llm):  # noqa: ANN001, ANN202
        free = await token_ids(llm, TokensPrompt(prompt), SamplingParams(max_tokens=12, **greedy))
        stop = tokenizer.decode(free[0][4:6], True)  # text from the middle of the free answer
        stopped = [o async for o in llm.generate(TokensPrompt(prompt),
                                                 SamplingParams(max_tokens=40, stop=[stop], **greedy))]
        last = stopped[-1].completions[-1]
        text = "".join(c.text for o in stopped for c in o.completions)
        fanned = await token_ids(llm, TokensPrompt(prompt), SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=10))
        return free, stop, (text, last.finish_reason, last.stop_string), fanned

    results = {}
    for overlap in ("off", "on"):
        core = make_engine(tiny_model_dir, overlap)
        busy_loop = EngineBusyLoop(core)
        busy_loop.start()
        try:
            results[overlap] = run_with_llm((core, busy_loop), tokenizer, body)
        finally:
            busy_loop.stop()
    free, stop, stopped, fanned = results["on"]
    assert stop and stopped[1] == FinishReason.STOP and stopped[2] == stop
    assert len(fanned) == 3 and all(len(tokens) == 10 for tokens in fanned.values())
    assert results["on"] == results["off"]
