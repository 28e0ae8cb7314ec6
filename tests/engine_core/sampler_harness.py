"""Sampler test harness: requests with given prompts/outputs/params and one sampler call on them."""

from __future__ import annotations

import itertools

import torch

from engine_core.protocol import SamplingParams
from engine_core.request import Request
from engine_core.sampler import Sampler, build_sampling_metadata

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


def run(requests: list[Request], logits: torch.Tensor, generators: dict | None = None):
    metadata = build_sampling_metadata(requests, {} if generators is None else generators, "cpu")
    return Sampler()(logits, metadata)


def counts(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).double()
