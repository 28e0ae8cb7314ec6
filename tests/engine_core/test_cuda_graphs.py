"""Decode batches padded to CUDA-graph buckets give the unpadded batch's answer.

A second ModelRunner with decode buckets shares the engine's model (weights) and runs
every step the engine's own (unpadded, eager) runner runs, in lockstep, on its own KV
cache. On CPU its padded buckets run eagerly (the seam the CUDA graphs replay through);
on CUDA the buckets are captured graphs and replayed.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.protocol import EngineCoreRequest, SamplingParams
from engine_core.runner.cuda_graphs import bucket_for, capture_sizes
from engine_core.runner.model_runner import ModelRunner
from engine_core.types import ModelRunnerOutput, SchedulerOutput
from tests.engine_core.tiny_models import write_tiny_model

BLOCK_SIZE = 4
SIZES = [1, 2, 4, 8]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# tests/conftest.py turns the interpreter on exactly when there is no GPU
INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on the GPU here, not in its CPU interpreter"
)


# ---- buckets ---------------------------------------------------------------------------
def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(130) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 130]
    with pytest.raises(ValueError, match="max_batch_size"):
        capture_sizes(0)


def test_bucket_for_picks_the_smallest_that_fits():
    sizes = capture_sizes(40)
    assert [bucket_for(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 40)] == [1, 2, 4, 8, 8, 16, 24, 40]
    assert bucket_for(sizes, 41) is None


# ---- lockstep: padded buckets vs the unpadded batch -------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-graphs"), vocab_size=256)


def make_core(folder, device: str, backend: str) -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=96),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        # the engine's own runner stays eager: it is the unpadded reference
        device=DeviceConfig(device=device, attention_backend=backend, enforce_eager=True),
    ))


def padded_runner(core: EngineCore) -> ModelRunner:
    """A runner over the same weights with decode buckets (captured as graphs on CUDA)."""
    reference = core.runner
    return ModelRunner(
        core.model, core.arch, core.attention, num_blocks=reference.num_blocks, block_size=BLOCK_SIZE,
        device=reference.device, dtype=reference.dtype, max_model_len=core.max_model_len,
        cuda_graph_sizes=SIZES,
    )


def fill_with_noise(runners: list[ModelRunner]) -> None:
    """The same random values in every runner's cache, in place (graphs keep pointing at it),
    so a stray write anywhere shows."""
    g = torch.Generator().manual_seed(3)
    for layer in zip(*(runner.kv_caches for runner in runners)):
        for i in range(2):  # key, value
            noise = torch.randn(layer[0][i].shape, generator=g)
            for kv in layer:
                kv[i].copy_(noise)


def flat_slots(runner: ModelRunner) -> torch.Tensor:
    """All layers' K and V per cache slot: [num_blocks * block_size, layers * 2 * Hkv * D]."""
    per_layer = [c.transpose(1, 2).flatten(2) for kv in runner.kv_caches for c in kv]  # [nb, bs, Hkv*D]
    return torch.cat(per_layer, dim=-1).flatten(0, 1)


def step_slots(scheduler_output: SchedulerOutput) -> set[int]:
    """The slots this step's real tokens write."""
    slots = set()
    for request in scheduler_output.scheduled_requests:
        end = request.num_computed_tokens  # already advanced past this step's tokens
        blocks = scheduler_output.block_ids[request.request_id]
        for pos in range(end - scheduler_output.num_scheduled_tokens[request.request_id], end):
            slots.add(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return slots


# A padded batch is a different computation from the unpadded one: the matmuls see more rows,
# and BLAS picks its blocking (so its summation order) by shape and by CPU. fp32 rounding then
# moves the tiny model's logprobs by ~1e-7..1e-6 (seen: 5e-7 on an AMD Zen 4); 1e-5 leaves
# headroom for other CPUs' kernels while a real bug (a padded row leaking into a real one, a
# wrong slot) moves them by >= 1e-2. Tokens and ranks must match exactly.
CPU_ATOL = 1e-5


def assert_same_output(actual: ModelRunnerOutput, expected: ModelRunnerOutput, atol: float) -> None:
    assert actual.sampled_token_ids == expected.sampled_token_ids
    assert actual.logprobs.keys() == expected.logprobs.keys()
    for request_id, ours in actual.logprobs.items():
        theirs = expected.logprobs[request_id]
        assert ours.token_ids == theirs.token_ids and ours.rank == theirs.rank
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=atol, rtol=0,
                                   msg=lambda m: f"{request_id}: {m}")


def requests() -> list[EngineCoreRequest]:
    """Six requests prefilled in one step, then decode batches of 6, 5 and 3 (which
    pad up to buckets 8 and 4); greedy with logprobs, and seeded sampling."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i, max_tokens in enumerate([2, 3, 3, 4, 4, 4]):
        prompt = torch.randint(4, 256, (3 + 2 * i,), generator=g).tolist()
        if i % 2:
            params = SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=max_tokens, ignore_eos=True)
        out.append(EngineCoreRequest(f"r{i}", prompt, params))
    return out


def run_lockstep(core: EngineCore, padded: ModelRunner, atol: float) -> list[int]:
    """Run every request to the end; returns the sizes of the decode batches that padded."""
    fill_with_noise([core.runner, padded])
    for request in requests():
        core.add_request(request)
    padded_batches = []
    while core.has_unfinished_requests():
        scheduler_output = core.scheduler.schedule()
        counts = scheduler_output.num_scheduled_tokens.values()
        if all(count == 1 for count in counts) and len(counts) not in SIZES:
            padded_batches.append(len(counts))
        before = flat_slots(padded).clone()
        expected = core.runner.execute_model(scheduler_output)
        actual = padded.execute_model(scheduler_output)
        assert_same_output(actual, expected, atol)

        # the padded rows wrote nothing: only this step's real slots changed
        after = flat_slots(padded)
        changed = (after != before).any(dim=-1).nonzero().flatten().tolist()
        assert set(changed) <= step_slots(scheduler_output)
        torch.testing.assert_close(after, flat_slots(core.runner), atol=atol, rtol=0)
        core.scheduler.update_from_output(scheduler_output, expected)
    return padded_batches


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", id="triton-interpreter", marks=INTERPRETER)])
def test_padded_decode_buckets_match_unpadded_batch_on_cpu(tiny_model_dir, backend):
    core = make_core(tiny_model_dir, "cpu", backend)
    padded = padded_runner(core)
    assert padded.decode_graphs is not None and not padded.decode_graphs.graphs  # eager, nothing captured
    padded_batches = run_lockstep(core, padded, atol=CPU_ATOL)
    assert padded_batches == [6, 5, 3]


def test_mixed_steps_and_oversized_batches_run_eagerly(tiny_model_dir):
    core = make_core(tiny_model_dir, "cpu", "torch")
    graphs = padded_runner(core).decode_graphs
    for request in requests()[:3]:
        core.add_request(request)
    scheduler_output = core.scheduler.schedule()  # three prefills
    metadata = core.runner._prepare_batch(scheduler_output).attn_metadata
    assert metadata.max_query_len > 1 and not graphs.can_run(metadata)
    metadata.max_query_len, metadata.block_tables = 1, metadata.block_tables[:, :1]
    assert graphs.can_run(metadata)
    metadata.seq_lens_cpu = [1] * (SIZES[-1] + 1)  # more requests than the largest bucket
    assert not graphs.can_run(metadata)


@CUDA
def test_cuda_graph_replay_matches_eager_decode(tiny_model_dir):
    core = make_core(tiny_model_dir, "cuda", "triton")
    assert core.runner.decode_graphs is None  # enforce_eager
    padded = padded_runner(core)
    assert sorted(padded.decode_graphs.graphs) == SIZES
    # graphs fix the split count per bucket and cuBLAS may pick other kernels per size:
    # equal tokens, logprobs equal to fp32 rounding
    padded_batches = run_lockstep(core, padded, atol=1e-4)
    assert padded_batches == [6, 5, 3]


@CUDA
def test_cuda_graphs_are_recaptured_after_the_kv_cache_moves(tiny_model_dir):
    core = make_core(tiny_model_dir, "cuda", "triton")
    padded = padded_runner(core)
    padded.free_kv_cache()
    assert padded.decode_graphs.graphs == {}
    padded.allocate_kv_cache()
    assert sorted(padded.decode_graphs.graphs) == SIZES
    run_lockstep(core, padded, atol=1e-4)


# ---- configuration ------------------------------------------------------------------------
def test_engine_on_cpu_runs_every_step_eagerly(tiny_model_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=80),
        device=DeviceConfig(device="cpu", attention_backend="triton"),  # graphs on by default, but no CUDA
    )
    assert EngineCore(config).runner.decode_graphs is None


def test_engine_flags_turn_graphs_off_and_cap_the_buckets():
    from services.engine.__main__ import build_parser, config_from_args

    parser = build_parser()
    default = config_from_args(parser.parse_args([])).device
    assert not default.enforce_eager and default.cuda_graph_max_batch_size == 256
    device = config_from_args(parser.parse_args(["--enforce-eager", "--cuda-graph-max-batch-size", "32"])).device
    assert device.enforce_eager and device.cuda_graph_max_batch_size == 32
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size must be >= 1"):
        config_from_args(parser.parse_args(["--cuda-graph-max-batch-size", "0"]))
