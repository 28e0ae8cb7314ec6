"""Draft-model proposals: a smaller model of the same tokenizer proposes its greedy continuation.

The draft runs in the engine's process on the engine's device, through a ModelRunner of its own (the same batch
building, attention backends, CPU decode layers and CUDA graphs as the target) over a paged KV cache of its own.
It keeps, per request, a Request of its own whose `all_token_ids[:num_computed_tokens]` are the tokens its KV
holds. Each call:

1. catches up: the request's tokens past the longest prefix its KV already holds (the newest tokens; and after a
   rejection, the tokens that replaced its rejected drafts) in one ragged step with every request's catch-up,
   the draft's argmax at the last one being the first draft;
2. decodes k - 1 steps, each feeding the previous draft.

Its drafts are argmaxes, taken as certain like every proposer's (engine_core/spec_decode/verification.py keeps the
output exact whatever they are). A request whose KV does not fit the draft's cache, or whose context passes the
draft's, gets no drafts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine_core.protocol import SamplingParams
from engine_core.request import Request
from engine_core.runner.model_runner import ModelRunner
from engine_core.scheduling.kv_cache_manager import KVCacheManager
from engine_core.spec_decode.proposer import DraftInput, Proposer
from engine_core.types import SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, *, max_model_len: int) -> None:
        """runner: the draft model's own; max_model_len: the longest context it proposes for."""
        self.runner = runner
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False)
        self.requests: dict[str, Request] = {}  # request id -> the draft's view: the tokens its KV holds

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {}
        chunks: dict[str, int] = {}  # request id -> tokens the catch-up step computes
        for item in inputs:
            if item.num_drafts > 0 and len(item.token_ids) + item.num_drafts - 1 < self.max_model_len:
                count = self._catch_up(item)
                if count:
                    chunks[item.request_id], drafts[item.request_id] = count, []
        sampled = self._step(chunks)
        wanted = {item.request_id: item.num_drafts for item in inputs}
        while sampled:
            for request_id, token_id in sampled.items():
                drafts[request_id].append(token_id)
            going = {request_id: 1 for request_id in sampled if len(drafts[request_id]) < wanted[request_id]}
            for request_id in going:  # feed the draft just made
                self.requests[request_id].all_token_ids.append(drafts[request_id][-1])
            sampled = self._step(going)
        return [drafts.get(item.request_id, []) for item in inputs]

    def _catch_up(self, item: DraftInput) -> int:
        """Point the draft's request at `item`'s tokens; the number to compute now (0: no room in the cache)."""
        request = self.requests.get(item.request_id)
        tokens = list(item.token_ids)
        if request is None:
            request = self.requests[item.request_id] = Request(item.request_id, tokens[:1], _GREEDY,
                                                               self.runner.block_size)
        held = request.all_token_ids[:request.num_computed_tokens]
        valid = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
        request.num_computed_tokens = valid = min(valid, len(tokens) - 1)  # the last token's logits are needed
        request.all_token_ids = tokens
        # room for the catch-up and the k - 1 drafts fed back
        if self.kv.allocate_slots(request, len(tokens) - valid + item.num_drafts - 1) is None:
            return 0
        return len(tokens) - valid

    def _step(self, counts: dict[str, int]) -> dict[str, int]:
        """One draft forward over these requests' next `counts` tokens; their argmax next tokens."""
        if not counts:
            return {}
        requests = [self.requests[request_id] for request_id in counts]
        for request in requests:
            request.num_computed_tokens += counts[request.request_id]
        output = self.runner.execute_model(SchedulerOutput(
            scheduled_requests=requests, num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
            block_ids={request_id: self.kv.get_block_ids(request_id) for request_id in counts},
        ))
        return output.sampled_token_ids

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
