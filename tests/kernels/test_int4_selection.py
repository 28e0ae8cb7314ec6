"""Int4 in the measured CPU linear choice (kernels/cpu/linear.py): `auto` takes int4 only where
it holds the weights exactly (a Q4_0/Q4_1 GGUF), `int4` falls back to int8 where torch cannot
pack, and a model on GGUF-4-bit weights gives the logits of its dequantized float twin."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine_core.loader.registry import prepare_for_cpu
from engine_core.loader.safetensors import load_hf
from engine_core.models.llama import LlamaForCausalLM
from kernels import LinearRole, select_backend
from kernels.cpu.linear import INT8_KERNELS, CpuLinear, int4_allowed, int4_is_exact, use_measured_linears
from tests.engine_core.tiny_models import PagedBatch, run_step, write_tiny_model


def prefer(kernel: str):
    """A deterministic timer under which `kernel` is fastest wherever it is a candidate."""
    def timer(name, rows, fn):
        fn()
        return 1.0 if name == kernel else 2.0
    return timer


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a Q4_1 GGUF stores it, dequantized to fp32 (what our GGUF loader yields)."""
    return torch.from_numpy(dequantize(quantize(weight.float().numpy(), GGMLQuantizationType.Q4_1),
                                       GGMLQuantizationType.Q4_1))


def test_int4_counts_as_exact_only_for_gguf_4bit_weights():
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * 0.05
    assert int4_is_exact(q4_1(weight))
    assert int4_is_exact(q4_1(weight).bfloat16())  # within bf16's own rounding of the same values
    assert not int4_is_exact(weight) and not int4_is_exact(weight.bfloat16())
    assert not int4_is_exact(q4_1(weight)[:24])  # a shape torch cannot pack as int4


def test_int4_is_allowed_by_int4_always_and_by_auto_only_where_exact():
    torch.manual_seed(2)
    weight = torch.randn(32, 64) * 0.05
    assert int4_allowed("auto", q4_1(weight)) and not int4_allowed("auto", weight)
    assert int4_allowed("int4", weight)
    assert not int4_allowed("int8", q4_1(weight)) and not int4_allowed("none", q4_1(weight))


def test_auto_takes_int4_only_where_it_is_exact_and_int4_falls_back_to_int8():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 64, bias=False),
                                torch.nn.Linear(64, 24, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(q4_1(model[0].weight))  # as loaded from a Q4_1 GGUF
    model.to(torch.bfloat16)  # auto in fp32 is the exact path: int4's bf16 arithmetic is past its budget
    plans = use_measured_linears(model, "auto", buckets=(1, 8), timer=prefer("int4"))
    assert plans[(32, 64)] == [(1, "int4"), (8, "int4")]
    assert all(name != "int4" for _, name in plans[(64, 32)] + plans[(24, 64)])  # float weights stay float

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(64, 24))  # 24 rows: no int4 packing
    plans = use_measured_linears(model, "int4", buckets=(1, 8), timer=prefer("int4"))
    assert plans[(32, 64)] == [(1, "int4"), (8, "int4")]
    # torch's int4 cannot pack 24 rows: int8 beside Tandem's int4 GEMV (which takes any rows, but
    # is timed only at decode's few rows)
    assert {name for _, name in plans[(24, 64)]} <= set(INT8_KERNELS) | {"int4_gemv"}


def test_model_on_gguf_4bit_weights_matches_its_dequantized_twin(tmp_path):
    folder = write_tiny_model(tmp_path, tie_word_embeddings=True)
    config, weights = load_hf(folder)
    # every matrix as a Q4_1 GGUF would hold it (the tied embedding is the LM head too)
    weights = {name: q4_1(t) if t.ndim == 2 else t for name, t in weights}

    def build(quantization: str, dtype: torch.dtype) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, select_backend("cpu", "torch"))
        model.load_weights(weights.items(), torch.device("cpu"), dtype)
        prepare_for_cpu(model, quantization, timer=prefer("int4"))
        return model.eval()

    # auto in bf16 (in fp32 it is the exact path, where int4's bf16 arithmetic is past the budget)
    ours, reference = build("auto", torch.bfloat16), build("none", torch.float32)
    layers = [m for m in ours.modules() if isinstance(m, CpuLinear)]
    assert len(layers) == 4 * config.num_hidden_layers + 1  # the LM head too
    assert all(name == "int4" for layer in layers for _, name in layer.plan)

    sequences = [[3, 17, 42, 5, 9, 100, 7], [250, 1, 2]]
    with torch.no_grad():
        got = torch.cat(run_step(ours, PagedBatch(config, 2, 16), list(enumerate(sequences))))
        want = torch.cat(run_step(reference, PagedBatch(config, 2, 16), list(enumerate(sequences))))
    # The same weights; int4's kernel rounds activations, scales and zeros to bf16 (8-bit
    # mantissas), so the logits differ as a bf16 run of the same model would: ~0.5 % of their
    # spread after 2 layers and the head, 2 % leaves room for other CPUs' kernels.
    got = got.float()
    error = (got - want).abs().max()
    assert error <= 2e-2 * want.abs().max()
    # greedy picks agree wherever the reference's top two are further apart than that error
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error
    assert clear.sum() >= len(want) // 2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_int4_leaves_the_lm_head_at_int8():
    model = torch.nn.Module()
    model.body, model.lm_head = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
    use_measured_linears(model, "int4", buckets=(1, 8), timer=prefer("int4"), roles={"lm_head": LinearRole.OUTPUT_HEAD})
    assert {name for _, name in model.body.plan} == {"int4"}
    assert {name for _, name in model.lm_head.plan} <= set(INT8_KERNELS)  # a head of the same shape too
