"""LoRA's shrink and expand on CPU: y += (x A_s^T) B_s for each row's slot s, five ways.

Each kernel adds into y [T, out] in place from x [T, in], the slot tensors A [S, R, in] and
B [S, R, out] and the step's `LoraStepIndex`; rows of slot -1 (the base model) are untouched. The
products run in the slots' dtype (fp32 on the CPU, where bf16 matmuls of LoRA's thin shapes cost several
times fp32's on CPUs without native bf16: docs/lora.md#measured), x cast to it and the sum cast back to y's.

- `per_slot`: the plain per-slot matmul (the baseline): each slot's rows gathered, two matmuls,
  added back with index_add.
- `segments`: SGMV-like (Punica, S-LoRA): rows come ordered by adapter, so each slot is one or
  two runs of rows; two matmuls per run on views, no gather or scatter.
- `gather_bmm`: BGMV-like: every row gathers its slot's A and B and one batched matmul each does
  every row at once; the gathered weights grow with the rows, so it is timed up to 32 rows only.
- `stacked`: every slot at once: x times all the A's ([T, S*R]), the other slots' columns zeroed
  by the row mask, times all the B's; S times the arithmetic, two GEMMs whatever the mix.
- `cpp`: BGMV in C++ (kernels/cpu/csrc/lora.cpp): up to four rows of one adapter per pass, rows over
  the threads, the ranks an adapter leaves empty skipped; one call whatever the mix. The CPU's
  one-op decoder layers run it inside the op (kernels/cpu/decode_layers.py).

Which wins depends on the CPU, the rows and the number of adapters in the step: the engine times
them at load (kernels/lora_ops.py) and takes the fastest per bucket. Their reference:
kernels/reference/lora.py.
"""

from __future__ import annotations

import torch

from kernels.cpu import extension as cpu_extension
from kernels.lora_index import LoraStepIndex


def add_lora_per_slot(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      index: LoraStepIndex) -> None:
    for slot, rows in index.groups:
        y.index_add_(0, rows, ((x.index_select(0, rows).to(a.dtype) @ a[slot].t()) @ b[slot]).to(y.dtype))


def add_lora_segments(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      index: LoraStepIndex) -> None:
    for slot, start, end in index.segments:
        shrunk = x[start:end].to(a.dtype) @ a[slot].t()
        if y.dtype == a.dtype:
            y[start:end].addmm_(shrunk, b[slot])
        else:
            y[start:end] += (shrunk @ b[slot]).to(y.dtype)


def add_lora_gather_bmm(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        index: LoraStepIndex) -> None:
    slots = index.clamped_slots
    shrunk = torch.bmm(a[slots], x.to(a.dtype).unsqueeze(2))  # [T, R, 1]
    if index.has_base_rows:
        shrunk = shrunk * index.mask.sum(1, keepdim=True).to(a.dtype)  # [T, 1, 1]: 0 for base rows
    y.add_(torch.bmm(shrunk.transpose(1, 2), b[slots]).squeeze(1).to(y.dtype))


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     index: LoraStepIndex) -> None:
    num_slots, rank = a.shape[0], a.shape[1]
    shrunk = (x.to(a.dtype) @ a.reshape(num_slots * rank, -1).t()).view(-1, num_slots, rank)  # [T, S, R]
    shrunk = (shrunk * index.mask.to(a.dtype)).view(-1, num_slots * rank)
    if y.dtype == a.dtype:
        y.addmm_(shrunk, b.reshape(num_slots * rank, -1))
    else:
        y.add_((shrunk @ b.reshape(num_slots * rank, -1)).to(y.dtype))


_EVERY_OUTPUT = torch.empty(0, dtype=torch.int64)  # no pieces: every rank reaches every output


def add_lora_cpp(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 index: LoraStepIndex) -> None:
    """Only where `cpu_lora_kernel_available("cpp")` (kernels/lora_ops.py asks before planning it)."""
    torch.ops.tandem.lora_add(y, x, a, b, index.slots, _EVERY_OUTPUT)


CPU_LORA_KERNELS = {
    "per_slot": add_lora_per_slot,
    "segments": add_lora_segments,
    "gather_bmm": add_lora_gather_bmm,
    "stacked": add_lora_stacked,
    "cpp": add_lora_cpp,
}
MAX_ROWS = {"gather_bmm": 32}  # per-row gathered weights: [T, R, in] + [T, R, out]
NEEDS_EXTENSION = {"cpp"}  # kernels of the C++ extension (kernels/cpu/extension.py): none without a compiler


def cpu_lora_kernel_available(name: str) -> bool:
    return name not in NEEDS_EXTENSION or cpu_extension.load()
