"""LoRA shrink/expand kernels (kernels/cpu/lora.py, kernels/triton/lora.py) against a row-by-row reference.

Rows of slot -1 are the base model's and must come back untouched; the other rows gain
x A_s^T B_s. The Triton kernels run in the CPU interpreter here (tests/conftest.py), on tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kernels import LoraStepIndex, select_lora_ops
from kernels.cpu.lora import CPU_LORA_KERNELS, NEEDS_EXTENSION, cpu_lora_kernel_available
from kernels.lora_ops import LoraPlan, choose_lora_plan
from kernels.reference.lora import add_lora as reference
from kernels.triton.lora import add_lora_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs on CPU tensors


def make_case(rows, num_slots, rank, in_f, out_f, dtype, seed, row_slots=None):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=generator).to(dtype)
    y = torch.randn(rows, out_f, generator=generator).to(dtype)
    a = torch.randn(num_slots, rank, in_f, generator=generator).to(dtype)
    b = torch.randn(num_slots, rank, out_f, generator=generator).to(dtype)
    if row_slots is None:
        row_slots = torch.randint(-1, num_slots, (rows,), generator=generator).tolist()
    return y, x, a, b, row_slots


@pytest.mark.parametrize("kernel", sorted(CPU_LORA_KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(rows=st.integers(1, 40), num_slots=st.integers(1, 4), rank=st.integers(1, 24), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_cpu_kernels_match_reference(kernel, dtype, rows, num_slots, rank, seed):
    y, x, a, b, row_slots = make_case(rows, num_slots, rank, 48, 40, dtype, seed)
    if kernel in NEEDS_EXTENSION:
        if not cpu_lora_kernel_available(kernel):
            pytest.skip("needs a C++ compiler for the CPU kernels")
        a, b = a.float(), b.float()  # its slots are fp32, as the CPU keeps them
    expected = reference(y, x, a, b, row_slots)
    CPU_LORA_KERNELS[kernel](y, x, a, b, LoraStepIndex(row_slots, num_slots, x.device, dtype))
    torch.testing.assert_close(y.float(), expected, atol=TOL[dtype] * 40, rtol=TOL[dtype])


def test_base_rows_are_untouched_bit_for_bit():
    y, x, a, b, _ = make_case(6, 2, 4, 16, 8, torch.float32, 1)
    row_slots = [-1, 0, -1, 1, 1, -1]
    before = y.clone()
    for name, kernel in CPU_LORA_KERNELS.items():
        if not cpu_lora_kernel_available(name):
            continue
        out = before.clone()
        kernel(out, x, a, b, LoraStepIndex(row_slots, 2, x.device, torch.float32))
        assert torch.equal(out[[0, 2, 5]], before[[0, 2, 5]])
        assert not torch.equal(out[[1, 3, 4]], before[[1, 3, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(rows=st.integers(1, 6), num_slots=st.integers(1, 3), rank=st.integers(1, 20),
       in_f=st.integers(1, 150), out_f=st.integers(1, 150), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
def test_triton_kernels_match_reference(dtype, rows, num_slots, rank, in_f, out_f, seed):
    """Odd sizes: the blocks of k (128), outputs (128) and ranks are masked at their ends."""
    y, x, a, b, row_slots = make_case(rows, num_slots, rank, in_f, out_f, dtype, seed)
    expected = reference(y, x, a, b, row_slots)
    y, x, a, b = (t.to(TRITON_DEVICE) for t in (y, x, a, b))
    add_lora_triton(y, x, a, b, LoraStepIndex(row_slots, num_slots, x.device, dtype))
    torch.testing.assert_close(y.float().cpu(), expected, atol=TOL[dtype] * 40, rtol=TOL[dtype])


def test_measured_plan_names_a_kernel_per_bucket_that_fits():
    calls = []

    def fake_timer(kernel, rows, fn):  # stacked wins at up to 8 rows, segments above: the plan must say so
        fn()
        calls.append(kernel)
        return 1.0 if kernel == ("stacked" if rows <= 8 else "segments") else 2.0

    plan = choose_lora_plan(16, 24, 8, 3, torch.float32, buckets=(1, 8, 32, 128), timer=fake_timer)
    assert plan.steps == [(1, "stacked"), (8, "stacked"), (32, "segments"), (128, "segments")]
    assert "gather_bmm" in calls and "per_slot" in calls
    assert plan.kernel_for(1000) == "segments"


def test_plan_runs_its_bucket_kernel():
    y, x, a, b, row_slots = make_case(10, 2, 4, 16, 8, torch.float32, 3)
    expected = reference(y, x, a, b, row_slots)
    LoraPlan([(8, "gather_bmm"), (512, "per_slot")]).add(y, x, a, b, LoraStepIndex(row_slots, 2, x.device,
                                                                                   torch.float32))
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_select_lora_ops():
    assert select_lora_ops("cpu", 4, torch.float32).kernel == "auto"
    assert select_lora_ops("cpu", 4, torch.float32, attention_backend="triton").kernel == "triton"
    assert select_lora_ops("cuda", 4, torch.float32).kernel == "triton"
    with pytest.raises(ValueError, match="CPU kernel"):
        select_lora_ops("cuda", 4, torch.float32, kernel="segments")
    with pytest.raises(ValueError, match="lora kernel must be one of"):
        select_lora_ops("cpu", 4, torch.float32, kernel="fast")


@pytest.mark.parametrize("kernel", [*sorted(CPU_LORA_KERNELS), "triton"])
def test_bf16_activations_over_fp32_slots(kernel):
    """The CPU keeps the slots in fp32 (kernels/lora_ops.py): bf16 rows in, the fp32 product added in bf16."""
    y, x, a, b, row_slots = make_case(9, 3, 8, 40, 24, torch.bfloat16, 5)
    a, b = a.float(), b.float()
    expected = reference(y, x, a, b, row_slots)
    run = add_lora_triton if kernel == "triton" else CPU_LORA_KERNELS[kernel]
    if kernel in NEEDS_EXTENSION and not cpu_lora_kernel_available(kernel):
        pytest.skip("needs a C++ compiler for the CPU kernels")
    if kernel == "triton":
        y, x, a, b = (t.to(TRITON_DEVICE) for t in (y, x, a, b))
    run(y, x, a, b, LoraStepIndex(row_slots, 3, x.device, torch.float32))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().cpu(), expected, atol=0.5, rtol=1e-2)  # one bf16 rounding of y


def test_the_cpu_keeps_slots_in_fp32():
    assert select_lora_ops("cpu", 4, torch.bfloat16).slot_dtype == torch.float32
    assert select_lora_ops("cuda", 4, torch.bfloat16).slot_dtype == torch.bfloat16


@pytest.mark.skipif(not cpu_lora_kernel_available("cpp"), reason="needs a C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kernel_expands_each_piece_over_its_own_outputs(dtype):
    """A fused module's slot (engine_core/lora/layers.py): rank block i reaches outputs pieces[s, i] only
    (B is zero elsewhere there; here it is not, so a kernel that read past its piece would be caught); a
    block an adapter leaves empty is (0, 0)."""
    y, x, a, b, row_slots = make_case(11, 3, 12, 40, 70, dtype, 9, row_slots=[0, 0, 0, 0, 0, -1, 1, 1, 2, 2, 2])
    a, b = a.float(), b.float()
    b_everywhere = b.clone()
    pieces = torch.tensor([[[0, 33], [33, 50], [50, 70]],   # q, k, v of a fused qkv, odd widths
                           [[0, 70], [0, 0], [0, 0]],       # one piece over every output (Phi-3's qkv_proj)
                           [[0, 0], [10, 42], [0, 0]]])     # only the middle piece
    for slot in range(3):
        for block in range(3):
            begin, end = pieces[slot, block].tolist()
            rows = slice(block * 4, block * 4 + 4)
            b[slot, rows, :begin] = 0
            b[slot, rows, end:] = 0
            if end == begin:
                a[slot, rows] = 0
    expected = reference(y, x, a, b, row_slots)
    torch.ops.tandem.lora_add(y, x, a, b_everywhere, torch.tensor(row_slots), pieces)
    torch.testing.assert_close(y.float(), expected, atol=TOL[dtype] * 40, rtol=TOL[dtype])
