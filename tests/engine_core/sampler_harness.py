"""Sampler test harness: requests with given prompts/outputs/params and one sampler call on them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine_core.protocol import SamplingParams, TokenLogprobs
from engine_core.request import Request
from engine_core.runner.sampler import Sampler, SamplingMetadata, build_sampling_metadata

_ids = itertools.count()


def make_request(
    prompt: list[int] | None = None, output: list[int] = (), eos: set[int] = frozenset(), **params
) -> Request:
    req = Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=list(prompt or [1, 2, 3]),
        sampling_params=SamplingParams(max_tokens=None, **params),
        block_size=4,
        eos_token_ids=frozenset(eos),
    )
    if output:
        req.append_output_token_ids(list(output))
    return req


@dataclass
class SamplerOutput:
    """One sampler call as plain lists; `logprobs` is None when no row asked for them.

    When some row asked, `logprobs` has one entry per row: that row's chosen token and
    top-N (its own N), or None for a row that did not ask.
    """

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


def sample_lists(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """`Sampler.sample` with its answer brought back to the host as lists."""
    sampled, logprobs = Sampler().sample(logits, metadata)
    return SamplerOutput(sampled.tolist(), logprobs)


def run(requests: list[Request], logits: torch.Tensor, generators: dict | None = None) -> SamplerOutput:
    metadata = build_sampling_metadata(requests, {} if generators is None else generators, "cpu")
    return sample_lists(logits, metadata)


def counts(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).double()
