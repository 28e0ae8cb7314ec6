"""Sampler logprobs: sampled-token logprobs are the raw distribution's, with top-n and rank;
prompt logprobs per position."""

from __future__ import annotations

import pytest
import torch

from engine_core.runner.sampler import compute_prompt_logprobs
from tests.engine_core.sampler_harness import make_request, run


# ---- logprobs -------------------------------------------------------------------------
def check_token_logprobs(entry, logprobs_row: torch.Tensor, token_id: int, n: int) -> None:
    assert entry.token_ids[0] == token_id and len(entry.token_ids) == len(entry.logprobs) == n + 1
    assert entry.logprobs[0] == pytest.approx(logprobs_row[token_id].item(), abs=1e-6)
    assert entry.rank == 1 + int((logprobs_row > logprobs_row[token_id]).sum())
    top_values = entry.logprobs[1:]
    assert top_values == sorted(top_values, reverse=True)
    torch.testing.assert_close(torch.tensor(top_values), logprobs_row.topk(n).values)
    assert [logprobs_row[t].item() for t in entry.token_ids[1:]] == pytest.approx(top_values, abs=1e-6)


def test_sample_logprobs_are_raw_topn_with_rank():
    torch.manual_seed(2)
    logits = torch.randn(6, 30) * 3
    nums = [None, 0, 1, 5, 20, 3]
    requests = [
        make_request(logprobs=n, temperature=t, repetition_penalty=1.5, logit_bias={4: 50.0})
        for n, t in zip(nums, [0.0, 1.0, 0.5, 2.0, 0.0, 1.0])
    ]
    out = run(requests, logits)
    raw = torch.log_softmax(logits, dim=-1)  # before bias, penalties and temperature
    assert out.logprobs[0] is None
    for i, n in enumerate(nums[1:], start=1):
        assert out.sampled_token_ids[i] == 4  # the bias decides the draw
        check_token_logprobs(out.logprobs[i], raw[i], 4, n)


def test_greedy_fast_path_logprobs():
    logits = torch.randn(4, 25)
    out = run([make_request(temperature=0.0, logprobs=2) for _ in range(4)], logits)
    raw = torch.log_softmax(logits, dim=-1)
    for i, entry in enumerate(out.logprobs):
        check_token_logprobs(entry, raw[i], out.sampled_token_ids[i], 2)
        assert entry.rank == 1


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("num_logprobs", [0, 4])
def test_prompt_logprobs(as_tensor, num_logprobs):
    logits = torch.randn(7, 40) * 2
    targets = [3, 9, 0, 39, 3, 17, 21]
    result = compute_prompt_logprobs(logits, torch.tensor(targets) if as_tensor else targets, num_logprobs)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(result) == len(targets)
    for i, entry in enumerate(result):
        check_token_logprobs(entry, raw[i], targets[i], num_logprobs)
