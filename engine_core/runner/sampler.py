"""The sampler: one token per row from the model's last-position logits, as in vLLM v1.

Per step:
1. logprobs from the raw logits (log_softmax before anything below; vLLM's "raw_logprobs"),
2. min_tokens masks (-inf) and logit_bias, added to the logits,
3. repetition / frequency / presence penalties,
4. greedy rows take the argmax; random rows divide by temperature, apply top-k, top-p and
   min-p, and draw with the exponential race argmax(probs / q), q ~ Exp(1).

Seeded rows draw their q from their own generator, one full vocabulary row per step, so a
seeded request samples the same tokens whatever else shares its batch. Unseeded random rows
share the default generator.
"""

from __future__ import annotations

import torch

from engine_core.protocol import TokenLogprobs
from engine_core.runner.sampling_metadata import (
    Penalties,
    SamplingMetadata,
    SparseAdd,
    build_sampling_metadata,
    make_generator,
)
from kernels import argmax

__all__ = [
    "Sampler",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
    "make_generator",
]


class Sampler:
    """Stateless; call `sample` once per step with the rows' logits and their metadata."""

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
        """The sampled ids left on the logits' device ([N] int64), and the logprobs when a row asked."""
        logits = logits.float()  # [N, V]
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if metadata.all_greedy and metadata.no_logit_changes:
            sampled = argmax(logits)  # the common case: one argmax
        else:
            sampled = sample(apply_logit_changes(logits, metadata), metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = to_token_logprobs(raw_logprobs, sampled, metadata.num_logprobs)
        return sampled, logprobs


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int] | torch.Tensor, num_logprobs: int
) -> list[TokenLogprobs]:
    """Logprob and rank of each actual next prompt token, plus the top-`num_logprobs`.

    logits: [Q, V], row i predicts target_token_ids[i].
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.as_tensor(target_token_ids, dtype=torch.int64, device=logits.device)
    return to_token_logprobs(logprobs, targets, [num_logprobs] * len(targets))


# ---- logits processing (before temperature) ------------------------------------------
def apply_logit_changes(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """min_tokens masks and logit_bias, then penalties; returns a new tensor."""
    if metadata.logit_adds is not None:
        logits = apply_sparse_add(logits, metadata.logit_adds)
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    return logits


def apply_sparse_add(logits: torch.Tensor, adds: SparseAdd) -> torch.Tensor:
    in_vocab = adds.token_ids < logits.shape[1]
    index = (adds.rows[in_vocab], adds.token_ids[in_vocab])
    return logits.index_put(index, adds.values[in_vocab], accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition over prompt + output tokens; frequency and presence over output tokens."""
    rows = logits[penalties.rows]  # [P, V]
    seen = torch.zeros_like(rows, dtype=torch.bool)
    seen[penalties.seen_index, penalties.seen_token_ids] = True
    counts = torch.zeros_like(rows)
    ones = torch.ones_like(penalties.output_token_ids, dtype=rows.dtype)
    counts.index_put_((penalties.output_index, penalties.output_token_ids), ones, accumulate=True)

    repetition = penalties.repetition.unsqueeze(1)
    penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(seen, penalized, rows)
    rows = rows - penalties.frequency.unsqueeze(1) * counts
    rows = rows - penalties.presence.unsqueeze(1) * (counts > 0)
    return logits.index_copy(0, penalties.rows, rows)


# ---- sampling ------------------------------------------------------------------------
def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[N, V] processed logits -> [N] token ids (greedy rows: argmax)."""
    greedy = None if metadata.all_random else argmax(logits)
    if metadata.all_greedy:
        return greedy
    random = exponential_race(logits_to_probs(logits, metadata), metadata.generators)
    if greedy is None:
        return random
    return torch.where(metadata.temperature == 0.0, greedy, random)


def logits_to_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, softmax. Greedy rows (temperature 0) pass through."""
    temperature = metadata.temperature
    logits = logits / torch.where(temperature == 0.0, 1.0, temperature).unsqueeze(1)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return logits.softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: all), then the smallest set with mass >= p."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if k is not None:
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if p is not None:
        mass_at_or_below = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_at_or_below <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False  # the top token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a draw from each row of `probs`.

    Rows in `generators` take their q from their own generator (V numbers per step);
    the other rows share the default generator in one call.
    """
    q = torch.empty_like(probs)  # [N, V]
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q == 0 is possible in float; the floor keeps zero-probability tokens at exactly 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return argmax(probs / q)


# ---- logprobs ------------------------------------------------------------------------
def to_token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Per row: the chosen token's logprob and rank, then the top-N sorted descending.

    logprobs: [R, V] log-softmaxed; token_ids: [R]; num_logprobs: N per row (None: skip row).
    Rank is 1 + the number of tokens with a strictly larger logprob.
    """
    max_n = min(max((n for n in num_logprobs if n is not None), default=0), logprobs.shape[1])
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(max_n, dim=-1)  # sorted descending
    ids = torch.cat([token_ids.unsqueeze(1), top.indices], dim=1).tolist()
    values = torch.cat([chosen, top.values], dim=1).tolist()
    return [
        None if n is None else TokenLogprobs(ids[i][: n + 1], values[i][: n + 1], ranks[i])
        for i, n in enumerate(num_logprobs)
    ]
