"""Verifying drafts: the target's logits at a request's last token and at its k drafts (k + 1 rows of one forward)
go through the engine's own sampler, row j as if it were the step after the first j drafts; the drafts are accepted
while each equals what the sampler drew at its row, and the first draw that differs (or the draw after the last
draft) ends the run.

This is rejection sampling for drafts taken as certain (every proposer here proposes a point mass): draft d at a
row whose distribution is p is accepted with probability p(d), and a rejection emits a draw from p conditioned on
not being d, which is p's residual max(0, p - 1[d]) normalised. Every emitted token is a draw from the target's
distribution given the tokens before it, so greedy output is the target's argmax token for token and sampled output
follows the target's distribution exactly, with every sampling parameter (temperature, top-k/p, min-p, min_tokens,
logit_bias, penalties: row j sees the drafts before it as output). Because the draw at each row uses the same noise
a step without speculation would, a seeded request's generator is rewound to where it would be after the tokens
actually emitted: its output is the same with speculation on or off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_core.protocol import TokenLogprobs
from engine_core.request import Request
from engine_core.runner.sampler import Sampler, build_sampling_metadata


@dataclass
class VerifyBatch:
    """The requests a step verifies, in batch order, their drafts and their rows in the step's batch."""

    requests: list[Request] = field(default_factory=list)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # each request's 1 + k rows in turn

    def add(self, request: Request, drafts: list[int], rows: range) -> None:
        self.requests.append(request)
        self.draft_token_ids.append(drafts)
        self.rows += rows


class DraftPosition:
    """A request as the sampler sees it at row j of its verification: the j drafts before the row as its output."""

    __slots__ = ("request", "drafts")

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request = request
        self.drafts = drafts

    def __getattr__(self, name: str):  # sampling_params, request_id, eos_token_ids, ...
        return getattr(self.request, name)

    grammar = None  # a request under a grammar does not speculate

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.drafts


def verify(sampler: Sampler, logits: torch.Tensor, batch: VerifyBatch, generators: dict[str, torch.Generator],
           ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """logits: [len(batch.rows), V], each request's k + 1 rows in turn. Per request, the tokens to emit (its accepted
    drafts, then one drawn) and their logprobs when it asked for them. `generators`: the runner's seeded generators
    by request id (created here for a seeded request's first draw)."""
    rows, owners = [], []
    for i, (request, drafts) in enumerate(zip(batch.requests, batch.draft_token_ids)):
        rows += [DraftPosition(request, drafts[:j]) for j in range(len(drafts) + 1)]
        owners += [i] * (len(drafts) + 1)
    metadata = build_sampling_metadata(rows, generators, logits.device)
    states = {owners[row]: (generator, generator.get_state()) for row, generator in metadata.generators.items()}
    sampled, logprobs = sampler.sample(logits, metadata)
    sampled = sampled.tolist()

    emitted: list[list[int]] = []
    emitted_logprobs: list[list[TokenLogprobs] | None] = []
    start = 0
    for request, drafts in zip(batch.requests, batch.draft_token_ids):
        draws = sampled[start:start + len(drafts) + 1]
        num_accepted = next((j for j, draft in enumerate(drafts) if draft != draws[j]), len(drafts))
        emitted.append(draws[:num_accepted + 1])
        wanted = logprobs is not None and request.sampling_params.logprobs is not None
        emitted_logprobs.append(logprobs[start:start + num_accepted + 1] if wanted else None)
        start += len(drafts) + 1
    for i, (generator, state) in states.items():
        rewind(generator, state, len(emitted[i]), logits.shape[1])
    return emitted, emitted_logprobs


def rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab_size: int) -> None:
    """Put `generator` where `num_draws` sampling steps from `state` leave it: the sampler's exponential race draws
    one row of vocab_size floats per step (engine_core/runner/sampler.py's exponential_race)."""
    generator.set_state(state)
    row = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_draws):
        row.exponential_(generator=generator)
