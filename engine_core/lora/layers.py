"""The model's modules with adapter slots: the base module's output plus each row's adapter product.

`LoraContext` is the step's state every wrapped module of one model shares: the rows' slots
(`index`, None when no row has an adapter, and then the wrapped modules cost one attribute read)
and, for the LM head, the slots of the rows whose logits are computed (`head_index`).

Slot tensors per module: A [S, R, in] and B [S, R, out], R = max_lora_rank x the module's pieces
(q, k, v for qkv_proj), zero where an adapter has no piece; an embedding keeps A as [S, vocab, R]
(a row per token id). `lora_pieces` [S, pieces, 2]: the outputs each block of ranks reaches.
Written by engine_core/lora/manager.py when an adapter takes a slot.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.lora.adapter import LoraPiece
from engine_core.lora.targets import LoraTarget
from kernels import LoraOps, LoraPlan, LoraStepIndex


class LoraContext:
    def __init__(self, ops: LoraOps) -> None:
        self.ops = ops
        self.index: LoraStepIndex | None = None  # this step's rows
        self.head_index: LoraStepIndex | None = None  # the rows the LM head is computing

    @property
    def active(self) -> bool:
        return self.index is not None


class LoraSlots(nn.Module):
    """One module's adapter slots, and how a piece is written into them."""

    def __init__(self, target: LoraTarget, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.target = target
        self.max_rank = max_rank
        rank = max_rank * target.num_pieces
        a_shape = (num_slots, target.in_features, rank) if target.kind == "embedding" else \
            (num_slots, rank, target.in_features)
        self.register_buffer("lora_a", torch.zeros(a_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, rank, target.out_features, dtype=dtype, device=device),
                             persistent=False)
        # per slot and block of max_rank ranks: the (first, end) outputs its B rows reach, (0, 0) for a block
        # the adapter leaves empty; the CPU kernel expands each block over those outputs only
        # (kernels/cpu/csrc/lora.cpp)
        self.register_buffer("lora_pieces", torch.zeros(num_slots, target.num_pieces, 2, dtype=torch.int64),
                             persistent=False)

    def write(self, slot: int, pieces: list[LoraPiece]) -> None:
        """Fill `slot` with an adapter's pieces of this module (none: zeros, the base model's output)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_pieces[slot].zero_()
        for piece in pieces:
            start = piece.index * self.max_rank
            rank = piece.a.shape[0]
            a = piece.a.to(self.lora_a.dtype)
            if self.target.kind == "embedding":
                self.lora_a[slot, :, start:start + rank] = a.t()
            else:
                self.lora_a[slot, start:start + rank] = a
            self.lora_b[slot, start:start + rank, piece.offset:piece.offset + piece.size] = piece.b.to(
                self.lora_b.dtype)
            self.lora_pieces[slot, piece.index] = torch.tensor([piece.offset, piece.offset + piece.size])


class LoraLinear(nn.Module):
    """base(x) + x A_s^T B_s per row (s: the row's slot), through the plan's kernel for the row count."""

    def __init__(self, base: nn.Module, slots: LoraSlots, context: LoraContext, plan: LoraPlan,
                 head: bool = False) -> None:
        super().__init__()
        self.base = base
        self.slots = slots
        self.context = context
        self.plan = plan
        self.head = head  # the LM head reads the rows being sampled, not the step's rows

    @property
    def in_features(self) -> int:
        return self.slots.target.in_features

    @property
    def out_features(self) -> int:
        return self.slots.target.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        index = self.context.head_index if self.head else self.context.index
        if index is not None:
            self.plan.add(y, x, self.slots.lora_a, self.slots.lora_b, index)
        return y


class LoraEmbedding(nn.Module):
    """base(ids) + A_s[id] B_s per row: the shrink is a row lookup, the expand a matmul per run of a slot."""

    def __init__(self, base: nn.Embedding, slots: LoraSlots, context: LoraContext) -> None:
        super().__init__()
        self.base = base
        self.slots = slots
        self.context = context

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.base(ids)
        index = self.context.index
        if index is not None:
            for slot, start, end in index.segments:
                h[start:end] += (self.slots.lora_a[slot, ids[start:end]] @ self.slots.lora_b[slot]).to(h.dtype)
        return h
