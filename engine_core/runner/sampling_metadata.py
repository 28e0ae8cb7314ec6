"""Per-step sampling inputs: one row per sampling request, tensors only for used features.

`build_sampling_metadata` runs every step on CPU for up to a few hundred rows, so it
loops over the requests once in Python and creates each tensor in one call, and only
when some row uses that feature. An all-greedy batch with nothing else set builds no
tensors at all and the sampler takes one argmax.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_core.request import Request
from engine_core.runner.host_to_device import to_device

_NO_TOP_K = 0


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own random stream; create once when a seeded request first samples."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SparseAdd:
    """Values added at (row, token) positions; tokens outside the vocabulary are ignored."""

    rows: torch.Tensor  # [K] int64
    token_ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] float32


@dataclass
class Penalties:
    """Repetition / frequency / presence penalties for the rows that use any of them."""

    rows: torch.Tensor  # [P] int64, batch rows with penalties
    repetition: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    # Flattened token histories: entry j is token_ids[j] of penalty row index[j] (0..P-1).
    seen_index: torch.Tensor  # prompt + output tokens (repetition penalty)
    seen_token_ids: torch.Tensor
    output_index: torch.Tensor  # output tokens only (frequency / presence)
    output_token_ids: torch.Tensor


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; rows follow the request order.

    A tensor field is None when no row uses that feature. `temperature` holds 0 for
    greedy rows; `top_k` holds 0 for rows without a top-k limit.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None  # [N] float32; None when all greedy
    top_p: torch.Tensor | None = None  # [N] float32
    top_k: torch.Tensor | None = None  # [N] int64
    min_p: torch.Tensor | None = None  # [N] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    # min_tokens masks (as -inf) and logit_bias, both plain additions to the logits.
    logit_adds: SparseAdd | None = None
    penalties: Penalties | None = None
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None: not wanted
    max_num_logprobs: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def no_logit_changes(self) -> bool:
        """True when the sampled distribution is the raw logits' (before temperature)."""
        return self.penalties is None and self.logit_adds is None


def build_sampling_metadata(
    requests: list[Request],
    generators: dict[str, torch.Generator],
    device: torch.device | str,
) -> SamplingMetadata:
    """Gather the sampling parameters of `requests` (batch order) into a SamplingMetadata.

    `generators` maps request id -> generator for seeded requests; a seeded random
    request with no entry yet gets one (`make_generator`), added to `generators`.
    """
    temps, top_ps, top_ks, min_ps = [], [], [], []
    row_generators: dict[int, torch.Generator] = {}
    add_rows, add_tokens, add_values = [], [], []
    penalty_rows: list[int] = []
    num_logprobs: list[int | None] = []
    for row, req in enumerate(requests):
        params = req.sampling_params
        greedy = params.is_greedy
        temps.append(0.0 if greedy else params.temperature)
        top_ps.append(1.0 if greedy else params.top_p)
        top_ks.append(_NO_TOP_K if greedy else params.top_k)
        min_ps.append(0.0 if greedy else params.min_p)
        if params.seed is not None and not greedy:
            if req.request_id not in generators:
                generators[req.request_id] = make_generator(params.seed, device)
            row_generators[row] = generators[req.request_id]
        if req.num_output_tokens < params.min_tokens and req.grammar is None:  # a grammar's mask does it
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= req.eos_token_ids
            add_rows += [row] * len(banned)
            add_tokens += banned
            add_values += [float("-inf")] * len(banned)
        if params.logit_bias:
            add_rows += [row] * len(params.logit_bias)
            add_tokens += params.logit_bias.keys()
            add_values += params.logit_bias.values()
        if params.needs_penalties:
            penalty_rows.append(row)
        num_logprobs.append(params.logprobs)

    tensor = functools.partial(_tensor, device=device)
    num_greedy = sum(t == 0.0 for t in temps)
    meta = SamplingMetadata(
        num_rows=len(requests),
        all_greedy=num_greedy == len(requests),
        all_random=num_greedy == 0,
        generators=row_generators,
        num_logprobs=num_logprobs,
        max_num_logprobs=max((n for n in num_logprobs if n is not None), default=None),
    )
    if not meta.all_greedy:
        meta.temperature = tensor(temps, torch.float32)
        if any(p < 1.0 for p in top_ps):
            meta.top_p = tensor(top_ps, torch.float32)
        if any(k != _NO_TOP_K for k in top_ks):
            meta.top_k = tensor(top_ks, torch.int64)
        if any(p > 0.0 for p in min_ps):
            meta.min_p = tensor(min_ps, torch.float32)
    if add_rows:
        meta.logit_adds = SparseAdd(
            tensor(add_rows, torch.int64), tensor(add_tokens, torch.int64), tensor(add_values, torch.float32)
        )
    if penalty_rows:
        meta.penalties = _build_penalties([requests[r] for r in penalty_rows], penalty_rows, device)
    return meta


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return to_device(values, dtype, device)  # on CUDA without waiting for the forward in flight


def _build_penalties(requests: list[Request], rows: list[int], device: torch.device | str) -> Penalties:
    """Penalty values and flattened token histories, one tensor per field."""
    tensor = functools.partial(_tensor, device=device)
    params = [req.sampling_params for req in requests]
    seen_lengths = [req.num_tokens for req in requests]
    output_lengths = [req.num_output_tokens for req in requests]
    positions = torch.arange(len(requests), device=device)
    return Penalties(
        rows=tensor(rows, torch.int64),
        repetition=tensor([p.repetition_penalty for p in params], torch.float32),
        frequency=tensor([p.frequency_penalty for p in params], torch.float32),
        presence=tensor([p.presence_penalty for p in params], torch.float32),
        seen_index=positions.repeat_interleave(tensor(seen_lengths, torch.int64)),
        seen_token_ids=_flat_tensor([req.all_token_ids for req in requests], sum(seen_lengths), device),
        output_index=positions.repeat_interleave(tensor(output_lengths, torch.int64)),
        output_token_ids=_flat_tensor([req.output_token_ids for req in requests], sum(output_lengths), device),
    )


def _flat_tensor(lists: list[list[int]], total: int, device: torch.device | str) -> torch.Tensor:
    """Concatenate token lists into one int64 tensor: numpy's fromiter, much faster than torch.tensor on a list
    (docs/benchmarks.md#host-work-per-decode-step)."""
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)
    return to_device(flat, torch.int64, device)
