"""Decoder layers as one C++ op at decode batches (kernels/cpu/decode_layers.py).

The op calls the module path's own kernels in the same order, so its answers are the module
path's exactly (the first layer's norm(x + 0) is norm(x) bit for bit); the load-time choice
between them is tested with a fixed timer. Needs the C++ kernels (a compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.loader import registry
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from kernels.cpu import extension as cpu_extension
from kernels.cpu.decode_layers import GEMV_MAX_ROWS, MAX_ROWS, OP_KERNELS
from kernels.cpu.int8_linear import int8_vnni_supported
from tests.engine_core.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")

PROMPT_LENGTHS = [3, 9, 14, 20, 6]  # prefill steps of 3 to 32 rows, decode steps of 5


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-one-op"), num_layers=3, vocab_size=256)


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory):  # a sliding window shorter than the prompts: the op passes it on
    return write_tiny_model(tmp_path_factory.mktemp("tiny-mistral-one-op"), model_type="mistral", num_layers=2,
                            vocab_size=256, sliding_window=8, head_dim=16)


def timer_preferring(winner: str, costs: dict[str, float] | None = None):
    """A load-time timer under which `winner` ('one_op' or 'modules'; several: 'one_op,one_op_plans') is twice
    as fast; linear kernels cost `costs[kernel]` ms (default 2: a tie, the first candidate wins)."""
    def timer(kernel, rows, fn):
        fn()  # every path really runs
        return 1e-3 if kernel in winner.split(",") else (costs or {}).get(kernel, 2.0) * 1e-3
    return timer


# linear plans whose 32-row kernels the op can call: int8_vnni for q/k/v, o and gate/up, and for
# down_proj (never W8A8) the bf16 GEMM in bf16 or the GEMV in fp32
OP_PLANS = {"int8_vnni": 1.0, "linear_bf16_packed": 1.2, "int8_gemv": 1.5}


def make_engine(folder, monkeypatch, winner="one_op", dtype="float32", quantization="int8", enforce_eager=False,
                costs=None):
    """An engine on the tiny model; with `costs`, the linear plans are timed by the fake clock too
    (else measured, or read from this machine's plan cache)."""
    monkeypatch.setattr(registry, "wall_timer", timer_preferring(winner, costs))
    if costs is not None:
        import kernels.cpu.linear as cpu_linear

        monkeypatch.setattr(cpu_linear, "_wall_timer", timer_preferring(winner, costs))
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(folder), dtype=dtype, quantization=quantization),
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        device=DeviceConfig(device="cpu", attention_backend="cpp", enforce_eager=enforce_eager),
    ))


def generate(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    engine.engine_core.reset_prefix_cache()
    outputs = engine.generate(prompts, params)
    completions = [o.completions[0] for o in outputs]
    return [(c.token_ids, [(lp.token_ids, lp.logprobs) for lp in c.logprobs]) for c in completions]


def answers_with_and_without_op(engine, max_rows):
    """Greedy answers with the op (checking it serves steps of up to max_rows rows, the decode steps
    among them) and without it."""
    model = engine.engine_core.model.model
    layers_op = model.decode_layers
    rows_seen = []

    def counting(h, *args):
        rows_seen.append(h.shape[0])
        return layers_op(h, *args)

    model.decode_layers = counting
    model.decode_layers.max_rows = layers_op.max_rows
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    with_op = generate(engine, prompts)
    assert rows_seen and max(rows_seen) <= max_rows and len(PROMPT_LENGTHS) in rows_seen  # the decode steps
    model.decode_layers = None
    without = generate(engine, prompts)
    model.decode_layers = layers_op
    return with_op, without, rows_seen


def linears_of(model):
    for layer in model.layers:
        yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("mistral", "bfloat16")])
def test_one_op_layers_answer_exactly_as_the_modules(request, monkeypatch, family, dtype):
    folder = request.getfixturevalue("tiny_model_dir" if family == "llama" else "tiny_mistral_dir")
    engine = make_engine(folder, monkeypatch, dtype=dtype, costs={"int8_gemv": 1.0})  # the GEMV's plan at 32 too
    model = engine.engine_core.model.model
    assert model.decode_layers is not None and model.decode_layers.max_rows == MAX_ROWS
    for linear in linears_of(model):  # the buckets the op serves run the GEMV on the module path too
        assert linear.kernel_for(1) == linear.kernel_for(MAX_ROWS) == "int8_gemv"
    with_op, without, _ = answers_with_and_without_op(engine, MAX_ROWS)
    assert with_op == without


def test_the_op_stops_below_a_bucket_whose_plan_it_cannot_run(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, monkeypatch, costs={"int8_weight_only": 1.0})  # torch's kernel at 32 rows
    model = engine.engine_core.model.model
    assert model.decode_layers.max_rows == GEMV_MAX_ROWS
    assert model.layers[0].mlp.gate_up_proj.kernel_for(MAX_ROWS) == "int8_weight_only"
    with_op, without, _ = answers_with_and_without_op(engine, GEMV_MAX_ROWS)
    assert with_op == without


@pytest.mark.skipif(not int8_vnni_supported(), reason="needs the AVX512-VNNI build (int8_vnni)")
@pytest.mark.parametrize("dtype, quantization, down, at_gemv_rows", [
    ("float32", "int8", "int8_gemv", "int8_gemv"),
    ("bfloat16", "int8", "int8_grouped", "int8_gemv"),  # down_proj's W8A8
    # auto: W8A8 and int8 weight-only are past a float checkpoint's accuracy budget; the op runs bf16 plans
    ("bfloat16", "auto", "linear_bf16_packed", "linear_bf16_packed")])
def test_above_the_gemv_buckets_the_op_runs_each_linears_plan(tiny_model_dir, monkeypatch, dtype, quantization, down,
                                                              at_gemv_rows):
    """Above 8 rows the op calls the kernels the linears' plans name there, so it answers as the modules."""
    from kernels.cpu.bf16_linear import bf16_packed_supported

    if "linear_bf16_packed" in (down, at_gemv_rows) and not bf16_packed_supported():
        pytest.skip("needs the AVX512-BF16 build (linear_bf16_packed)")
    costs = {**OP_PLANS, "int8_grouped": 1.1} if down == "int8_grouped" else OP_PLANS
    others_int8 = quantization == "int8"
    winner = "one_op" if others_int8 else "one_op,one_op_plans"  # no GEMV within auto's budget here
    engine = make_engine(tiny_model_dir, monkeypatch, winner, dtype=dtype, quantization=quantization, costs=costs)
    model = engine.engine_core.model.model
    # auto's 128-row plans are F.linear, which the op does not call: it stops at 32
    assert model.decode_layers is not None and model.decode_layers.max_rows == (MAX_ROWS if others_int8 else 32)
    layer = model.layers[0]
    others = "int8_vnni" if others_int8 else "linear_bf16_packed"
    assert [linear.kernel_for(32) for linear in linears_of(model)][:4] == [others] * 3 + [down]
    assert layer.mlp.down_proj.kernel_for(GEMV_MAX_ROWS) == at_gemv_rows
    with_op, without, rows_seen = answers_with_and_without_op(engine, MAX_ROWS)
    assert any(rows > GEMV_MAX_ROWS for rows in rows_seen)  # the longer prompts' prefill steps
    assert with_op == without


@pytest.mark.skipif(not int8_vnni_supported(), reason="needs the AVX512-VNNI build (int8_vnni)")
def test_at_the_gemv_buckets_the_op_may_run_the_linears_own_plans(tiny_model_dir, monkeypatch):
    """Where the plans name kernels the op can call (W8A8's int8_vnni at a few rows), that variant
    is timed beside the GEMVs; where it wins the plans stay, and the answers are the modules'."""
    # the op on the plans fastest at the GEMV buckets, and faster than the modules above them
    engine = make_engine(tiny_model_dir, monkeypatch, winner="one_op_plans", costs={**OP_PLANS, "one_op": 1.5})
    model = engine.engine_core.model.model
    assert model.decode_layers is not None and model.decode_layers.max_rows == MAX_ROWS
    qkv_kind = 3  # the op's arguments per layer: two norms, eps, then qkv's kind
    for rows in (1, GEMV_MAX_ROWS):
        assert model.layers[0].self_attn.qkv_proj.kernel_for(rows) == "int8_vnni"
        assert model.decode_layers.weights[rows][0][qkv_kind] == OP_KERNELS["int8_vnni"]
    with_op, without, _ = answers_with_and_without_op(engine, MAX_ROWS)
    assert with_op == without


@pytest.mark.skipif(not int8_vnni_supported(), reason="needs the AVX512-VNNI build (int4_gemv)")
def test_int4_weights_run_the_int4_gemv_in_the_op(tiny_model_dir, monkeypatch):
    """With int4 weights the op's GEMV buckets are timed with the int4 GEMV too; where that wins,
    the op and the linears' plans both run it there, and the answers stay the modules'."""
    engine = make_engine(tiny_model_dir, monkeypatch, winner="one_op_int4", quantization="int4")
    model = engine.engine_core.model.model
    # above the GEMV buckets the plans name torch's int4, which the op cannot call
    assert model.decode_layers is not None and model.decode_layers.max_rows == GEMV_MAX_ROWS
    for linear in linears_of(model):
        assert linear.kernel_for(1) == linear.kernel_for(GEMV_MAX_ROWS) == "int4_gemv"
        assert linear.state("int8_gemv") is None  # the int8 copy the op was also timed with is freed
    with_op, without, _ = answers_with_and_without_op(engine, GEMV_MAX_ROWS)
    assert with_op == without


def test_the_modules_stay_where_they_measure_faster(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, monkeypatch, winner="modules")
    assert engine.engine_core.model.model.decode_layers is None


@pytest.mark.parametrize("setting", [{"quantization": "none"}, {"enforce_eager": True}])
def test_no_op_without_the_gemv_or_the_fused_ops(tiny_model_dir, monkeypatch, setting):
    engine = make_engine(tiny_model_dir, monkeypatch, **setting)
    assert engine.engine_core.model.model.decode_layers is None


def test_no_op_for_layers_it_does_not_cover(tmp_path, monkeypatch):
    folder = write_tiny_model(tmp_path / "qwen3", model_type="qwen3", vocab_size=256)  # q/k norms
    engine = make_engine(folder, monkeypatch)
    assert engine.engine_core.model.model.decode_layers is None
