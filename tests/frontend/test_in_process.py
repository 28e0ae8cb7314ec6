"""AsyncLLM over InProcessEngineClient: a real EngineCore busy loop in this process, no gRPC.

A tiny random Llama with SmolLM2's vocabulary (so the real tokenizer works) gives the same greedy
tokens through the frontend as the offline LLMEngine; fan-out, stop strings, cancels and the
utility calls go through the same AsyncLLM code as over gRPC, and every request leaves the engine.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import FinishReason, OutputKind, SamplingParams
from services.engine.busy_loop import EngineBusyLoop
from services.engine.processes.engine_process import run_beside_engine
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.in_process import InProcessEngineClient
from services.frontend.errors import EngineUnavailable
from services.frontend.input_processor import TextPrompt, TokensPrompt
from tests.engine_core.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14], [500, 600, 700], [42] * 9]


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory, tokenizer) -> EngineConfig:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-in-process"), vocab_size=tokenizer.vocab_size)
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
        device=DeviceConfig(device="cpu", attention_backend="torch"),
    )


@pytest.fixture(scope="module")
def engine(engine_config):
    """One EngineCore stepped by a busy loop on its own thread, shared by the module's tests."""
    core = EngineCore(engine_config)
    busy_loop = EngineBusyLoop(core)
    busy_loop.start()
    yield core, busy_loop
    busy_loop.stop()


def run_with_llm(engine, tokenizer, body):
    """Run `body(llm)` on a fresh event loop with AsyncLLM over a new in-process connection."""
    core, busy_loop = engine

    async def main():
        client = InProcessEngineClient(busy_loop, core.info)
        await client.start()
        llm = AsyncLLM(client, tokenizer)
        try:
            return await body(llm)
        finally:
            await llm.shutdown()
            await client.close()

    result = asyncio.run(main())
    wait_idle(core)
    return result


def wait_idle(core: EngineCore, timeout_s: float = 30.0) -> None:
    """Until the engine holds no request (aborts and finishes are applied on the loop thread)."""
    import time

    deadline = time.monotonic() + timeout_s
    while core.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.get_num_unfinished_requests() == 0


async def token_ids(llm: AsyncLLM, prompt, params: SamplingParams) -> dict[int, list[int]]:
    """Every completion's token ids by index (DELTA outputs concatenated)."""
    tokens: dict[int, list[int]] = {}
    async for output in llm.generate(prompt, params):
        for completion in output.completions:
            tokens.setdefault(completion.index, []).extend(completion.token_ids)
    return tokens


def test_greedy_tokens_match_the_offline_engine(engine, engine_config, tokenizer):
    offline = LLMEngine(engine_config)
    outputs = offline.generate(PROMPTS, SamplingParams(max_tokens=8, **GREEDY))
    expected = [out.completions[0].token_ids for out in outputs]

    async def body(llm):
        results = await asyncio.gather(*(token_ids(llm, TokensPrompt(p), SamplingParams(max_tokens=8, **GREEDY))
                                         for p in PROMPTS))
        return [r[0] for r in results]

    assert run_with_llm(engine, tokenizer, body) == expected


def test_fan_out_finish_reasons_and_usage(engine, tokenizer):
    async def body(llm):
        outputs = [o async for o in llm.generate(TextPrompt("Hello there"),
                                                 SamplingParams(n=2, max_tokens=5, seed=7, temperature=1.0,
                                                                ignore_eos=True, output_kind=OutputKind.FINAL_ONLY))]
        return outputs

    outputs = run_with_llm(engine, tokenizer, body)
    last = outputs[-1]
    assert last.finished and last.usage.completion_tokens == 10
    finished = [c for o in outputs for c in o.completions]
    assert sorted(c.index for c in finished) == [0, 1]
    assert all(c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 5 for c in finished)


def test_cancel_and_stop_strings_abort_in_the_engine(engine, tokenizer):
    async def body(llm):
        long = llm.generate(TokensPrompt(PROMPTS[0]), SamplingParams(max_tokens=100, **GREEDY))
        await anext(long)
        await long.aclose()  # a client that goes away: AsyncLLM aborts the request in the engine
        # A stop string that is the completion's own text after two tokens ends it early.
        first = await token_ids(llm, TokensPrompt(PROMPTS[1]), SamplingParams(max_tokens=4, **GREEDY))
        stop = tokenizer.decode(first[0][:2], True)
        stopped = [o async for o in llm.generate(TokensPrompt(PROMPTS[1]),
                                                 SamplingParams(max_tokens=100, stop=[stop], **GREEDY))]
        return llm.engine_client.num_in_flight, stop, stopped

    in_flight, stop, stopped = run_with_llm(engine, tokenizer, body)
    assert in_flight == 0
    assert stop, "the first two greedy tokens decode to no text; pick another prompt"
    assert stopped[-1].completions[-1].finish_reason == FinishReason.STOP
    assert stopped[-1].completions[-1].stop_string == stop


def test_utility_calls_and_a_closed_client(engine, tokenizer):
    async def body(llm):
        results = [await llm.pause_generation("keep"), await llm.resume_generation(), await llm.reset_prefix_cache()]
        await llm.engine_client.close()
        with pytest.raises(EngineUnavailable):
            llm.add_request(TokensPrompt(PROMPTS[0]), SamplingParams(max_tokens=2))
        return results

    results = run_with_llm(engine, tokenizer, body)
    assert [r.ok for batch in results for r in batch] == [True, True, True]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs pytest's main thread")
def test_run_beside_engine_steps_on_the_main_thread(engine_config, tokenizer):
    """The in-process transport's full-speed layout (services/engine/processes/engine_process.py): the frontend on a
    background event loop, the engine stepping on the main thread, stopped when the frontend is done."""
    core = EngineCore(engine_config)
    busy_loop = EngineBusyLoop(core)
    step_threads: list[threading.Thread] = []
    step_cpus: list[set[int]] = []
    step = core.step

    def recording_step():
        step_threads.append(threading.current_thread())
        step_cpus.append(os.sched_getaffinity(0))
        return step()

    core.step = recording_step
    allowed = os.sched_getaffinity(0)

    async def main():
        client = InProcessEngineClient(busy_loop, core.info)
        await client.start()
        llm = AsyncLLM(client, tokenizer)
        try:
            tokens = (await token_ids(llm, TokensPrompt(PROMPTS[0]), SamplingParams(max_tokens=6, **GREEDY)))[0]
            return tokens, os.sched_getscheduler(0), os.sched_getaffinity(0)
        finally:
            await llm.shutdown()
            await client.close()

    tokens, io_policy, io_cpus = run_beside_engine(busy_loop, main, io_cpu_priority="idle")
    assert len(tokens) == 6
    assert io_policy == os.SCHED_IDLE  # the frontend's side at the priority asked for (make bench's transport side)
    assert step_threads and all(t is threading.main_thread() for t in step_threads)
    # --step-cpu's default: the step on one CPU, the frontend's side on the others; unpinned afterwards
    if len(allowed) > 1:
        assert len(step_cpus[0]) == 1 and io_cpus == allowed - step_cpus[0]
    else:
        assert step_cpus[0] == io_cpus == allowed
    assert os.sched_getaffinity(0) == allowed
    assert not busy_loop.alive  # stopped once main() returned


def test_embed_over_the_in_process_client_and_its_validation(engine, tokenizer):
    from engine_core.protocol import PoolingParams, PoolingType
    from services.frontend.errors import InvalidRequest

    core, _ = engine

    async def body(llm):
        mean = PoolingParams(PoolingType.MEAN, normalize=False)
        together = await llm.embed([TokensPrompt(p) for p in PROMPTS], mean, "e")
        alone = [await llm.embed([TokensPrompt(p)], mean) for p in PROMPTS]
        with pytest.raises(InvalidRequest, match="inputs\\[1\\] is empty"):
            await llm.embed([TokensPrompt(PROMPTS[0]), None], mean)
        with pytest.raises(InvalidRequest, match="too long"):
            await llm.embed([TokensPrompt([5] * 128)], mean)
        return together, alone

    together, alone = run_with_llm(engine, tokenizer, body)
    assert together.request_id == "e" and together.num_prompt_tokens == [len(p) for p in PROMPTS]
    assert together.usage.prompt_tokens == sum(len(p) for p in PROMPTS) and together.usage.completion_tokens == 0
    for vector, single in zip(together.embeddings, alone):  # batched with each other or alone: the same
        torch.testing.assert_close(torch.tensor(vector), torch.tensor(single.embeddings[0]), atol=1e-5, rtol=0)
    assert len(together.embeddings[0]) == core.arch.hidden_size
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
