"""One step's map from batch rows to LoRA slots, built once per step and read by every LoRA layer.

The slot tensors of a layer are [S, R, in] (A, the shrink) and [S, R, out] (B, the expand, the
adapter's scaling folded in); slot -1 is the base model. Each CPU kernel reads the form it needs:
the runs of equal slots (`segments`, rows are ordered by adapter within the decodes and within the
prefills, so each adapter is one or two runs), the rows of each slot (`groups`), a one-hot row
mask over the slots (`mask`) or the slot of every row (`slots`, also what the Triton kernels read).
"""

from __future__ import annotations

from functools import cached_property

import torch


class LoraStepIndex:
    def __init__(self, row_slots: list[int], num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.row_slots = row_slots  # host list, one slot per row (-1: base)
        self.num_rows = len(row_slots)
        self.num_slots = num_slots
        self.device = device
        self.dtype = dtype

    @cached_property
    def slots(self) -> torch.Tensor:  # [T] int64
        return torch.tensor(self.row_slots, dtype=torch.int64, device=self.device)

    @cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        """(slot, first row, end row) of each run of rows with one adapter."""
        runs = []
        start = 0
        for row in range(1, self.num_rows + 1):
            if row == self.num_rows or self.row_slots[row] != self.row_slots[start]:
                if self.row_slots[start] >= 0:
                    runs.append((self.row_slots[start], start, row))
                start = row
        return runs

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its rows [n] int64) per slot in use."""
        rows: dict[int, list[int]] = {}
        for row, slot in enumerate(self.row_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(row)
        return [(slot, torch.tensor(r, dtype=torch.int64, device=self.device)) for slot, r in rows.items()]

    @cached_property
    def mask(self) -> torch.Tensor:  # [T, S, 1]: 1 in the row's slot, 0 elsewhere (and for base rows)
        mask = torch.zeros(self.num_rows, self.num_slots, 1, dtype=self.dtype, device=self.device)
        for slot, rows in self.groups:
            mask[rows, slot] = 1
        return mask

    @cached_property
    def clamped_slots(self) -> torch.Tensor:  # [T]: base rows read slot 0, their result masked out
        return self.slots.clamp(min=0)

    @cached_property
    def has_base_rows(self) -> bool:
        return any(slot < 0 for slot in self.row_slots)

    def select(self, rows: list[int]) -> "LoraStepIndex | None":
        """The index of a subset of rows (the LM head's), or None when none of them has an adapter."""
        row_slots = [self.row_slots[row] for row in rows]
        if all(slot < 0 for slot in row_slots):
            return None
        return LoraStepIndex(row_slots, self.num_slots, self.device, self.dtype)
