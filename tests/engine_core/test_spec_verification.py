"""The verification of drafts on its own: emitted tokens follow the target's distribution whatever the drafts,
greedy rows emit the argmax, seeded generators end where steps without speculation would leave them."""

from __future__ import annotations

import pytest
import torch

from engine_core.protocol import SamplingParams
from engine_core.request import Request
from engine_core.runner.sampler import Sampler
from engine_core.runner.sampling_metadata import make_generator
from engine_core.spec_decode.verification import VerifyBatch, verify

VOCAB = 8
NUM_DRAWS = 20_000


def make_batch(drafts: list[int], params: SamplingParams, count: int, output: list[int] = ()) -> VerifyBatch:
    batch = VerifyBatch()
    rows = 0
    for i in range(count):
        request = Request(str(i), [1, 2, 3], params, block_size=4)
        request.append_output_token_ids(list(output))
        batch.add(request, list(drafts), range(rows, rows + len(drafts) + 1))
        rows += len(drafts) + 1
    return batch


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a step without speculation samples (temperature and top-k only, as used here)."""
    scaled = logits / params.temperature
    if params.top_k:
        kth = scaled.topk(params.top_k).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(-1)


def total_variation(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


# drafts: the likeliest token, an unlikely one, a token top-k removes (probability 0), and a likely run
@pytest.mark.parametrize("drafts", [[0, 0], [7, 3], [6, 6], [0, 1, 2]], ids=["likely", "unlikely", "impossible", "k3"])
@pytest.mark.parametrize("top_k", [0, 6])
def test_emitted_tokens_follow_the_target_distribution(drafts, top_k):
    torch.manual_seed(0)
    # one distribution per row position, the likeliest token first: draft 0 is accepted often, 7 seldom
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]]).repeat(len(drafts) + 1, 1)
    logits += torch.randn(logits.shape) * 0.3
    params = SamplingParams(temperature=0.9, top_k=top_k)
    batch = make_batch(drafts, params, NUM_DRAWS)
    emitted, _ = verify(Sampler(), logits.repeat(NUM_DRAWS, 1), batch, {})
    probs = target_probs(logits, params)  # [k + 1, V]
    # position 0 is a draw from row 0's distribution whatever the draft was
    first = [tokens[0] for tokens in emitted]
    assert total_variation(first, probs[0]) < 0.02
    # the draft at position 0 was accepted as often as the target draws it
    accepted = sum(len(tokens) > 1 for tokens in emitted) / NUM_DRAWS
    assert abs(accepted - probs[0, drafts[0]].item()) < 0.02
    # given the first draft accepted, position 1 is a draw from row 1's distribution
    second = [tokens[1] for tokens in emitted if len(tokens) > 1]
    if len(second) > 2000:
        assert total_variation(second, probs[1]) < 0.03
    assert all(len(tokens) <= len(drafts) + 1 for tokens in emitted)
    for tokens in emitted:  # a prefix of the drafts, then one drawn token
        assert tokens[:-1] == drafts[:len(tokens) - 1]


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = torch.full((4, VOCAB), 0.0)
    for row, best in enumerate([3, 5, 1, 6]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0.0)
    cases = {(3, 5, 1): [3, 5, 1, 6], (3, 5, 2): [3, 5, 1], (4, 5, 1): [3], (3,): None}
    for drafts, expected in cases.items():
        rows = logits[:len(drafts) + 1]
        emitted, _ = verify(Sampler(), rows, make_batch(list(drafts), params, 1), {})
        assert emitted[0] == (expected or [3, 5])


def test_min_tokens_bans_eos_at_the_rows_before_it():
    """Row j sees the j drafts before it as output: min_tokens (and penalties) count them."""
    request_eos = 7
    logits = torch.zeros((3, VOCAB))
    logits[:, request_eos] = 5.0  # EOS is the argmax everywhere
    logits[:, 2] = 4.0
    params = SamplingParams(temperature=0.0, min_tokens=3)
    batch = VerifyBatch()
    request = Request("r", [1, 2], params, block_size=4, eos_token_ids=frozenset({request_eos}))
    request.append_output_token_ids([2])  # one output token: rows 0 and 1 are below min_tokens, row 2 is not
    batch.add(request, [2, 2], range(3))
    emitted, _ = verify(Sampler(), logits, batch, {})
    assert emitted[0] == [2, 2, request_eos]


def test_logprobs_are_those_of_each_emitted_token():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    best = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    emitted, logprobs = verify(Sampler(), logits, make_batch([best[0], (best[1] + 1) % VOCAB], params, 1), {})
    assert emitted[0] == best[:2]
    raw = torch.log_softmax(logits, -1)
    assert [entry.token_ids[0] for entry in logprobs[0]] == emitted[0]
    for row, entry in enumerate(logprobs[0]):
        assert entry.logprobs[0] == pytest.approx(raw[row, emitted[0][row]].item(), abs=1e-6)
        assert entry.token_ids[1:] == raw[row].topk(2).indices.tolist()


def test_a_seeded_generator_is_left_where_the_emitted_steps_leave_it():
    """Each row draws with the noise a step of its own would; the rows past the emitted ones are given back."""
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, seed=77)
    # without speculation: one step per token, each from its own row's logits
    generators: dict[str, torch.Generator] = {}
    plain = []
    for row in range(4):
        batch = make_batch([], params, 1, output=plain)
        plain += verify(Sampler(), logits[row:row + 1], batch, generators)[0][0]
    # with: drafts that agree with the first two draws, then one that cannot (unless it is drawn)
    drafts = plain[:2] + [(plain[2] + 1) % VOCAB]
    generators = {}
    emitted, _ = verify(Sampler(), logits, make_batch(drafts, params, 1), generators)
    assert emitted[0] == plain[:3]
    expected = make_generator(77, "cpu")
    for _ in range(3):
        torch.empty(VOCAB).exponential_(generator=expected)
    assert torch.equal(generators["0"].get_state(), expected.get_state())
