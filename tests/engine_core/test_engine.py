"""The whole engine (scheduler + runner + model + sampler) on a tiny random Llama, fp32, CPU.

The reference is transformers' `generate` on the same checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import EngineCoreRequest, FinishReason, OutputKind, SamplingParams
from kernels.cpu import extension as cpu_extension
from tests.engine_core.tiny_models import write_tiny_model

BLOCK_SIZE = 4
VOCAB = 256
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length greedy continuations
    return model


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPP = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")
# tests/conftest.py turns the interpreter on exactly when there is no GPU
INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on the GPU here, not in its CPU interpreter"
)


def engine_config(
    folder, *, backend="torch", num_blocks=None, budget=16, max_num_seqs=32, prefix_caching=True, max_model_len=None,
    device="cpu", enforce_eager=False,
):
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks or 512, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        device=DeviceConfig(device=device, attention_backend=backend, enforce_eager=enforce_eager),
    )


def make_prompts() -> list[list[int]]:
    """Ten prompts of different lengths; four share a 3-block (12-token) prefix."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(4, VOCAB, (3 * BLOCK_SIZE,), generator=g).tolist()
    lengths = [1, 3, 7, 13, 21, 30, 45]
    own = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
    with_prefix = [shared + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17)]
    return own[:3] + [shared + [5]] + with_prefix + own[3:]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, logprobs


def run_engine(config: EngineConfig, prompts, params) -> tuple[list, int]:
    """All prompts through EngineCore; returns per-request token lists and the preemption count."""
    core = EngineCore(config)
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, p))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    preemptions = 0
    while core.has_unfinished_requests():
        outputs = core.step()
        preemptions += outputs.scheduler_stats.num_preemptions
        for out in outputs.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
    return [tokens[f"r{i}"] for i in range(len(prompts))], preemptions


# ---- 1. parity with transformers ------------------------------------------------------------
@pytest.mark.parametrize(
    "device, backend, enforce_eager",
    [
        pytest.param("cpu", "torch", True, id="cpu-torch-eager"),  # the pure-torch reference path
        pytest.param("cpu", "torch", False, id="cpu-torch-fused", marks=CPP),
        pytest.param("cpu", "cpp", False, id="cpu-cpp-fused", marks=CPP),
        pytest.param("cpu", "cpp", True, id="cpu-cpp-eager", marks=CPP),
        pytest.param("cpu", "triton", False, id="triton-interpreter", marks=INTERPRETER),
        pytest.param("cuda", "triton", False, id="cuda-triton-graphs", marks=CUDA),
        pytest.param("cuda", "triton", True, id="cuda-triton-eager", marks=CUDA),
        pytest.param("cuda", "torch", False, id="cuda-torch", marks=CUDA),
    ],
)
def test_greedy_parity_with_transformers(tiny_model_dir, hf_model, device, backend, enforce_eager):
    prompts = make_prompts()
    max_tokens = 10
    config = engine_config(tiny_model_dir, backend=backend, budget=16, device=device, enforce_eager=enforce_eager)
    engine = LLMEngine(config)
    graphs = engine.engine_core.runner.decode_graphs
    captured = device == "cuda" and backend == "triton" and not enforce_eager  # the torch reference never is
    assert (graphs is not None and len(graphs.graphs) > 0) == captured
    fused = not enforce_eager  # the C++ layer ops on the CPU, the Triton ones on CUDA
    assert engine.info.attention_backend == backend
    assert (engine.engine_core.model.model.norm.fused is not None) == fused
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = engine.generate(prompts, params)
    cached = [o.usage.cached_tokens for o in outputs]
    assert max(cached) >= 3 * BLOCK_SIZE, f"the shared prefix was never a cache hit: {cached}"
    for prompt, output in zip(prompts, outputs):
        completion = output.completions[0]
        ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt, max_tokens)
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert completion.finish_reason == FinishReason.LENGTH
        for step, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
            expected = ref[torch.tensor(ours.token_ids)]
            diff = (torch.tensor(ours.logprobs) - expected).abs().max().item()
            assert diff < LOGPROB_ATOL, f"prompt len {len(prompt)}, step {step}: logprob diff {diff:.2e}"
            assert ours.token_ids[1:] == torch.topk(ref, 5).indices.tolist()


# ---- 2. preemption -----------------------------------------------------------------------------
def test_preemption_gives_identical_output(tiny_model_dir):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, VOCAB, (10 + 3 * i,), generator=g).tolist() for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free_run, free_preemptions = run_engine(engine_config(tiny_model_dir, budget=64), prompts, params)
    # about two requests' worth of KV: (10+21+24)/4 ≈ 14 blocks each
    tight = engine_config(tiny_model_dir, num_blocks=30, budget=64, max_model_len=64)
    tight_run, tight_preemptions = run_engine(tight, prompts, params)
    assert free_preemptions == 0
    assert tight_preemptions > 0
    assert tight_run == free_run


# ---- 3. prefix cache -----------------------------------------------------------------------------
def test_prefix_cache_hit_skips_shared_blocks(tiny_model_dir):
    core = EngineCore(engine_config(tiny_model_dir, budget=256))
    prefix = list(range(10, 10 + 3 * BLOCK_SIZE))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    core.add_request(EngineCoreRequest("first", prefix + [40, 41], params))
    while core.has_unfinished_requests():
        core.step()
    core.add_request(EngineCoreRequest("second", prefix + [50, 51, 52], params))
    scheduler_output = core.scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {"second": 3}
    runner_output = core.runner.execute_model(scheduler_output)
    outputs = core.scheduler.update_from_output(scheduler_output, runner_output)
    assert outputs.outputs[0].num_cached_tokens == 3 * BLOCK_SIZE
    assert outputs.scheduler_stats.prefix_cache_hits == 3 * BLOCK_SIZE


def test_prefix_cache_does_not_change_output(tiny_model_dir):
    prompts = make_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with_cache, _ = run_engine(engine_config(tiny_model_dir), prompts, params)
    without_cache, _ = run_engine(engine_config(tiny_model_dir, prefix_caching=False), prompts, params)
    assert with_cache == without_cache


# ---- 4. seeded sampling --------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir):
    prompt = list(range(20, 35))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone, _ = run_engine(engine_config(tiny_model_dir), [prompt], seeded)
    again, _ = run_engine(engine_config(tiny_model_dir), [prompt], seeded)
    assert alone == again
    g = torch.Generator().manual_seed(3)
    others = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    other_params = [
        SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=1.2, seed=99, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=8, ignore_eos=True),
    ]
    crowded, _ = run_engine(
        engine_config(tiny_model_dir, budget=8),
        others[:2] + [prompt] + others[2:], other_params[:2] + [seeded] + other_params[2:],
    )
    assert crowded[2] == alone[0]
    different_seed, _ = run_engine(
        engine_config(tiny_model_dir), [prompt],
        SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12, ignore_eos=True),
    )
    assert different_seed != alone


# ---- 5. the offline engine API --------------------------------------------------------------------
def test_llm_engine_fan_out_abort_and_stop_tokens(tiny_model_dir):
    engine = LLMEngine(engine_config(tiny_model_dir))
    prompt = list(range(30, 42))
    engine.add_request("fan", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    engine.add_request("doomed", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    assert engine.get_num_unfinished_requests() == 2
    engine.step()
    engine.abort_request("doomed")
    engine.abort_request("doomed")  # idempotent
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert set(finished) == {"fan"}  # DELTA: the last message holds the completions that ended in its step
    fan = engine.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in fan.completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in fan.completions)
    assert len({tuple(c.token_ids) for c in fan.completions}) > 1  # children draw differently
    core = engine.engine_core
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1

    # a stop token ends the request with its id as the stop reason
    greedy = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop_at = greedy.completions[0].token_ids[3]
    first = greedy.completions[0].token_ids.index(stop_at)
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert stopped.completions[0].token_ids == greedy.completions[0].token_ids[: first + 1]
    assert stopped.completions[0].finish_reason == FinishReason.STOP
    assert stopped.completions[0].stop_token_id == stop_at


def test_bad_requests_are_rejected_with_clear_errors(tiny_model_dir):
    core = EngineCore(engine_config(tiny_model_dir))
    with pytest.raises(ValueError, match="prompt is empty"):
        core.add_request(EngineCoreRequest("a", [], SamplingParams()))
    with pytest.raises(ValueError, match="out of range: the vocabulary has 256 tokens"):
        core.add_request(EngineCoreRequest("b", [1, 999], SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len is 256"):
        core.add_request(EngineCoreRequest("c", [5] * 256, SamplingParams()))
    core.add_request(EngineCoreRequest("d", [5, 6], SamplingParams()))
    with pytest.raises(ValueError, match="already in flight"):
        core.add_request(EngineCoreRequest("d", [5, 6], SamplingParams()))
    assert not core.scheduler.get_request("a")


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.CUMULATIVE, OutputKind.FINAL_ONLY])
def test_llm_engine_streams_by_output_kind(tiny_model_dir, kind):
    """DELTA messages concatenate, CUMULATIVE ones each hold all so far, FINAL_ONLY sends one: all three give the
    same tokens per child as the same seeded request does in generate()."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True, output_kind=kind)
    engine = LLMEngine(engine_config(tiny_model_dir))
    engine.add_request("s", list(range(30, 40)), params)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    messages = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            messages.append(output)
            for completion in output.completions:
                if kind == OutputKind.DELTA:
                    streamed[completion.index].extend(completion.token_ids)
                else:
                    streamed[completion.index] = list(completion.token_ids)
    assert messages[-1].finished and messages[-1].usage.completion_tokens == 14
    assert len(messages) == 1 if kind == OutputKind.FINAL_ONLY else len(messages) >= 7
    whole = LLMEngine(engine_config(tiny_model_dir)).generate([list(range(30, 40))], params)[0]
    assert streamed == {c.index: c.token_ids for c in whole.completions}
    assert all(len(tokens) == 7 for tokens in streamed.values())
