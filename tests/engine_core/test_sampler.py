"""Sampler tests: greedy, random draws and their filters, seeds, penalties (logprobs:
test_sampler_logprobs.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine_core.request import Request
from engine_core.runner.sampler import (
    apply_logit_changes,
    apply_top_k_top_p,
    build_sampling_metadata,
    sample,
)
from tests.engine_core.sampler_harness import counts, make_request, run, sample_lists


# ---- greedy ---------------------------------------------------------------------------
def test_greedy_is_argmax_and_builds_no_tensors():
    logits = torch.randn(8, 50)
    requests = [make_request(temperature=0.0) for _ in range(8)]
    metadata = build_sampling_metadata(requests, {}, "cpu")
    assert metadata.all_greedy and metadata.no_logit_changes and metadata.max_num_logprobs is None
    assert metadata.temperature is None and metadata.top_k is None and metadata.top_p is None
    out = sample_lists(logits, metadata)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_fast_path_matches_general_path():
    logits = torch.randn(16, 100)
    requests = [make_request(temperature=0.0, top_k=5, seed=i) for i in range(16)]
    metadata = build_sampling_metadata(requests, {}, "cpu")
    assert metadata.generators == {}  # seeds do not matter to greedy rows
    general = sample(apply_logit_changes(logits, metadata), metadata).tolist()
    assert sample_lists(logits, metadata).sampled_token_ids == general == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.randn(6, 40)
    requests = [make_request(temperature=0.0 if i % 2 else 1.5, top_p=0.5) for i in range(6)]
    sampled = run(requests, logits).sampled_token_ids
    assert sampled[1::2] == logits[1::2].argmax(-1).tolist()


def test_sampler_leaves_the_input_logits_alone():
    logits = torch.randn(3, 20)
    before = logits.clone()
    requests = [make_request(temperature=0.5, top_k=3, repetition_penalty=1.5, logit_bias={1: 2.0}) for _ in range(3)]
    run(requests, logits)
    assert torch.equal(logits, before)


# ---- random sampling ------------------------------------------------------------------
@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded):
    torch.manual_seed(0)
    num_draws, temperature = 3000 if seeded else 10000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    requests = [make_request(temperature=temperature, seed=i if seeded else None) for i in range(num_draws)]
    sampled = run(requests, row.expand(num_draws, -1)).sampled_token_ids
    expected = torch.softmax(row.double() / temperature, dim=-1)
    observed = counts(sampled, len(row)) / num_draws
    sigma = (expected * (1 - expected) / num_draws).sqrt()
    assert ((observed - expected).abs() <= 5 * sigma + 1e-9).all(), (observed, expected)


def reference_allowed(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens that top-k, then top-p, then min-p keep, one plain step at a time."""
    probs = torch.softmax(row.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t] for t in kept)
    cumulative, top_p_kept = 0.0, []
    for t in kept:
        top_p_kept.append(t)
        cumulative += probs[t] / mass
        if cumulative >= top_p:
            break
    largest = probs[top_p_kept[0]]
    return {t for t in top_p_kept if probs[t] >= min_p * largest}


FILTERS = [
    dict(top_k=3),
    dict(top_p=0.6),
    dict(min_p=0.3),
    dict(top_k=5, top_p=0.8, min_p=0.1, temperature=1.3),
    dict(top_p=0.01),  # only the top token survives
]


def test_filters_never_sample_excluded_tokens():
    torch.manual_seed(1)
    vocab_size, draws_per_filter = 20, 1500
    row = torch.randn(vocab_size)
    # Every filter in one batch, interleaved: per-row parameters must stay per row.
    requests = [make_request(**FILTERS[i % len(FILTERS)]) for i in range(draws_per_filter * len(FILTERS))]
    sampled = run(requests, row.expand(len(requests), -1)).sampled_token_ids
    for f, params in enumerate(FILTERS):
        allowed = reference_allowed(
            row, params.get("temperature", 1.0), params.get("top_k", 0), params.get("top_p", 1.0),
            params.get("min_p", 0.0),
        )
        drawn = set(sampled[f :: len(FILTERS)])
        assert drawn <= allowed, (params, drawn - allowed)
        if params.get("top_p") == 0.01:
            assert drawn == {int(row.argmax())}


@settings(max_examples=100, deadline=None)
@given(
    logits=st.lists(st.integers(-40, 40), min_size=2, max_size=12, unique=True),
    top_k=st.integers(0, 14),
    top_p=st.floats(0.05, 1.0),
)
def test_top_k_top_p_mask_matches_reference(logits, top_k, top_p):
    row = torch.tensor(logits, dtype=torch.float32) / 10
    probs = torch.softmax(row.double(), -1)
    kept_by_k = probs.argsort(descending=True)[: top_k or len(logits)]
    cumulative = (probs[kept_by_k] / probs[kept_by_k].sum()).cumsum(0)
    assume(((cumulative - top_p).abs() > 1e-4).all())  # float rounding decides exact ties
    masked = apply_top_k_top_p(row[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    kept = set(torch.nonzero(masked > float("-inf")).flatten().tolist())
    assert kept == reference_allowed(row, 1.0, top_k, top_p, 0.0)
    assert torch.equal(masked[list(kept)], row[list(kept)])


# ---- seeds ----------------------------------------------------------------------------
def step_logits(step: int, vocab_size: int = 64) -> torch.Tensor:
    """Fixed, flat-ish logits per step so that a seed (not the logits) decides the draw."""
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 + step)) * 0.3


def generate(target_params: dict, neighbours: list[dict], position: int, steps: int = 12) -> list[int]:
    """Run the target request for `steps` steps inside a batch of other requests."""
    target = make_request(**target_params)
    others = [make_request(**params) for params in neighbours]
    generators: dict = {}
    for step in range(steps):
        batch = others[:position] + [target] + others[position:]
        logits = torch.randn(len(batch), 64)
        logits[position] = step_logits(step)
        out = run(batch, logits, generators)
        for req, token in zip(batch, out.sampled_token_ids):
            req.append_output_token_ids(token)
    return target.output_token_ids


TARGET = dict(seed=1234, temperature=0.9, top_k=40, top_p=0.95)
NEIGHBOURS = [
    dict(seed=7),
    dict(),
    dict(temperature=0.0),
    dict(seed=99, top_p=0.5),
    dict(temperature=2.0, min_p=0.05),
    dict(seed=1234),  # same seed, its own generator
    dict(repetition_penalty=1.3, logprobs=3),
]


def test_seeded_request_reproduces_across_runs():
    first = generate(TARGET, [], 0)
    assert generate(TARGET, [], 0) == first
    assert generate(dict(TARGET, seed=4321), [], 0) != first


@pytest.mark.parametrize("position", [0, 3, 7])
def test_seeded_request_ignores_its_batch(position):
    alone = generate(TARGET, [], 0)
    assert generate(TARGET, NEIGHBOURS, position) == alone
    assert generate(TARGET, [dict(seed=5)], min(position, 1)) == alone


def test_missing_generators_are_created_for_seeded_random_rows_only():
    requests = [make_request(seed=3), make_request(seed=3, temperature=0.0), make_request()]
    generators: dict = {}
    metadata = build_sampling_metadata(requests, generators, "cpu")
    assert list(generators) == [requests[0].request_id]
    assert metadata.generators == {0: generators[requests[0].request_id]}


# ---- min_tokens, logit bias, penalties ------------------------------------------------
def reference_processed_logits(row: list[float], req: Request) -> list[float]:
    """min_tokens mask, logit bias and penalties for one row, the plain-Python way."""
    params, out = req.sampling_params, list(row)
    vocab = range(len(out))
    if req.num_output_tokens < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(req.eos_token_ids))
        for t in banned & set(vocab):
            out[t] = -math.inf
    for t, bias in params.logit_bias.items():
        if t in vocab:
            out[t] += bias
    for t in set(req.prompt_token_ids) | set(req.output_token_ids):
        out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t in set(req.output_token_ids):
        out[t] -= params.frequency_penalty * req.output_token_ids.count(t) + params.presence_penalty
    return out


VOCAB = 10
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=8)
request_params = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 1.0]),
        "repetition_penalty": st.sampled_from([1.0, 0.5, 1.3, 2.0]),
        "frequency_penalty": st.sampled_from([0.0, -1.0, 0.7, 2.0]),
        "presence_penalty": st.sampled_from([0.0, -2.0, 0.4, 1.5]),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB + 2), st.floats(-100, 100), max_size=3),
        "min_tokens": st.integers(0, 4),
        "stop_token_ids": st.lists(st.integers(0, VOCAB + 2), max_size=2),
        "ignore_eos": st.booleans(),
    }
)
rows = st.tuples(
    request_params,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),  # prompt
    tokens,  # output so far
)


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(rows, min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_logit_changes_match_reference(batch, seed):
    requests = [make_request(prompt, output, eos={0, 3}, **params) for params, prompt, output in batch]
    logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    metadata = build_sampling_metadata(requests, {}, "cpu")
    expected = torch.tensor([reference_processed_logits(row, req) for req, row in zip(requests, logits.tolist())])
    torch.testing.assert_close(apply_logit_changes(logits, metadata), expected.float(), rtol=1e-5, atol=1e-4)
    greedy_rows = [i for i, req in enumerate(requests) if req.sampling_params.is_greedy]
    sampled = sample_lists(logits, metadata).sampled_token_ids
    for i in greedy_rows:
        assert expected[i].max() - expected[i, sampled[i]] <= 1e-4


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    eos, stop = 5, 7
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, 2] = 10.0, 9.0, 8.0
    req = make_request(eos={eos}, min_tokens=3, stop_token_ids=[stop, 1000], ignore_eos=ignore_eos, temperature=0.0)
    for _ in range(4):
        req.append_output_token_ids(run([req], logits).sampled_token_ids[0])
    first_three = [2, 2, 2] if not ignore_eos else [eos] * 3
    assert req.output_token_ids == first_three + [eos]


def test_logit_bias_steers_random_rows():
    logits = torch.zeros(50, 8)
    requests = [make_request(logit_bias={6: 100.0}, top_k=2) for _ in range(50)]
    assert run(requests, logits).sampled_token_ids == [6] * 50
