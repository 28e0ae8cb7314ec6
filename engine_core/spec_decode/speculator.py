"""The model runner's part of speculative decoding behind one object: after a step samples, propose drafts for the
next step of each request that may speculate; in the next step, verify them (engine_core/spec_decode/verification.py).

A request whose drafts keep being rejected rests: after a verification that accepts nothing, its next
2^misses - 1 steps (at most MAX_REST) get no drafts, `misses` counting such verifications in a row; any accepted
draft ends the count. Fresh text, where prompt lookup finds matches that the model does not follow, then costs
about one verification in MAX_REST steps instead of one every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_core.runner.sampler import Sampler
from engine_core.spec_decode.proposer import DraftInput, Proposer
from engine_core.spec_decode.verification import VerifyBatch, verify
from engine_core.types import ModelRunnerOutput

if TYPE_CHECKING:
    from engine_core.runner.model_runner import _Batch

MAX_REST = 16  # steps


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_batch: int) -> None:
        """max_batch: the most requests sampling in a step for which the next step is proposed drafts (the
        scheduler verifies none while more than that many requests run)."""
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_batch = max_batch
        self._misses: dict[str, int] = {}  # request id -> verifications in a row that accepted no draft
        self._rest: dict[str, int] = {}  # request id -> steps left without drafts

    def propose(self, batch: _Batch, output: ModelRunnerOutput) -> None:
        """Drafts (into output.draft_token_ids) for the requests that sampled this step and may speculate: not under
        a grammar (its drafts would need the matcher's rollback), and not turned off by the request."""
        requests = batch.sampling_requests + (batch.verify.requests if batch.verify is not None else [])
        if len(requests) > self.max_batch:
            return
        inputs = []
        for request in requests:
            request_id = request.request_id
            verified = output.verified_token_ids.get(request_id)
            if verified is not None:
                self._observe(request_id, len(verified) - 1)
            if not request.sampling_params.speculative or request.grammar is not None or self._resting(request_id):
                continue
            new = verified or [output.sampled_token_ids[request_id]]
            inputs.append(DraftInput(request_id, request.all_token_ids + new, self.num_speculative_tokens))
        for item, drafts in zip(inputs, self.proposer.propose(inputs)):
            if drafts:
                output.draft_token_ids[item.request_id] = drafts

    def verify(self, sampler: Sampler, logits: torch.Tensor, batch: VerifyBatch,
               generators: dict[str, torch.Generator], output: ModelRunnerOutput) -> torch.Tensor:
        """logits: [N + len(batch.rows), V], the verified rows last. Fills output.verified_token_ids (and
        verified_logprobs); returns the first N rows, the other requests' to sample."""
        num_sampled = logits.shape[0] - len(batch.rows)
        emitted, logprobs = verify(sampler, logits[num_sampled:], batch, generators)
        for request, tokens, token_logprobs in zip(batch.requests, emitted, logprobs):
            output.verified_token_ids[request.request_id] = tokens
            if token_logprobs is not None:
                output.verified_logprobs[request.request_id] = token_logprobs
        return logits[:num_sampled]

    def _observe(self, request_id: str, num_accepted: int) -> None:
        if num_accepted:
            self._misses.pop(request_id, None)
            return
        misses = self._misses[request_id] = self._misses.get(request_id, 0) + 1
        self._rest[request_id] = min(2**misses - 1, MAX_REST)

    def _resting(self, request_id: str) -> bool:
        """True (and one step less to go) while the request rests."""
        left = self._rest.get(request_id)
        if not left:
            return False
        if left == 1:
            del self._rest[request_id]
        else:
            self._rest[request_id] = left - 1
        return True

    def forget(self, request_ids) -> None:  # noqa: ANN001 - any iterable of ids
        """The finished requests' state, here and in the proposer."""
        for request_id in request_ids:
            self._misses.pop(request_id, None)
            self._rest.pop(request_id, None)
        self.proposer.forget(request_ids)
