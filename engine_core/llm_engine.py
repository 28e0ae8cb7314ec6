"""The offline engine: vLLM's LLMEngine API over an in-process EngineCore.

Token ids in, token ids out (no tokenizer: `text` stays empty). It yields the same RequestOutput as the
frontend's AsyncLLM, per the request's output kind (DELTA: each step's new tokens, CUMULATIVE: all so far,
FINAL_ONLY: one message at the end). `n > 1` fans out into child requests that share the prompt (and so its
prefix-cache blocks), as the frontend does; their outputs come back under the parent's id, told apart by
`index`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.protocol import (
    CompletionOutput,
    EngineCoreOutput,
    EngineCoreRequest,
    LoraInfo,
    OutputKind,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    Usage,
)


@dataclass
class _Completion:
    """One child's progress, kept whole whatever the output kind."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False


@dataclass
class _OfflineRequest:
    output_kind: OutputKind
    num_prompt_tokens: int
    completions: list[_Completion]
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.engine_core = EngineCore(config or EngineConfig())
        self._requests: dict[str, _OfflineRequest] = {}  # parent request id -> its progress
        self._children: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)
        self._ids = itertools.count()

    @property
    def info(self):
        return self.engine_core.info

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Checked by `EngineCore.validate_request` (ValueError naming the problem) before anything is queued.
        `lora_name`: a loaded LoRA adapter to run the request with (None: the base model)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        params = sampling_params or SamplingParams()
        if isinstance(params.n, bool) or not isinstance(params.n, int) or params.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {params.n!r}")
        request = EngineCoreRequest(request_id, list(prompt_token_ids), params, time.time(), priority,
                                    lora_name=lora_name)
        children = request.fan_out()
        for child in children:  # validate all before queueing any
            self.engine_core.validate_request(child)
        for index, child in enumerate(children):
            self.engine_core.add_request(child)
            self._children[child.request_id] = (request_id, index)
        self._requests[request_id] = _OfflineRequest(
            params.output_kind, len(request.prompt_token_ids), [_Completion() for _ in children])

    # ---- LoRA adapters (docs/lora.md), as vLLM's LLMEngine names them ------------------
    def add_lora(self, name: str, path: str) -> LoraInfo:
        return self.engine_core.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine_core.remove_lora(name)

    def pin_lora(self, name: str) -> LoraInfo:
        return self.engine_core.pin_lora(name)

    def list_loras(self) -> list[LoraInfo]:
        return self.engine_core.list_loras()

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Idempotent; aborting a parent aborts all its children."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        parents = set(request_ids)
        child_ids = [child for child, (parent, _) in self._children.items() if parent in parents]
        self.engine_core.abort_requests(child_ids)
        for child in child_ids:
            del self._children[child]
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; one RequestOutput per request with news, per its output kind (a finished
        request is seen here for the last time)."""
        news: dict[str, list[tuple[int, EngineCoreOutput]]] = {}
        for output in self.engine_core.step().outputs:
            parent_id, index = self._children[output.request_id]
            if output.finished:
                del self._children[output.request_id]
            news.setdefault(parent_id, []).append((index, output))
        results = []
        for parent_id, outputs in news.items():
            request = self._requests[parent_id]
            result = self._output(parent_id, request, outputs)
            if request.finished:
                del self._requests[parent_id]
            if result is not None:
                results.append(result)
        return results

    @staticmethod
    def _output(request_id: str, request: _OfflineRequest,
                outputs: list[tuple[int, EngineCoreOutput]]) -> RequestOutput | None:
        delta = request.output_kind == OutputKind.DELTA
        changed = []
        for index, output in outputs:
            completion = request.completions[index]
            completion.token_ids.extend(output.new_token_ids)
            completion.logprobs.extend(output.new_logprobs or ())
            completion.finished = output.finished
            if index == 0:
                request.prompt_logprobs.extend(output.new_prompt_logprobs or ())
            request.num_cached_tokens = max(request.num_cached_tokens, output.num_cached_tokens)
            if output.new_token_ids or output.finished:
                changed.append(CompletionOutput(
                    index=index, text="",
                    token_ids=list(output.new_token_ids) if delta else list(completion.token_ids),
                    logprobs=list(output.new_logprobs or ()) if delta else list(completion.logprobs),
                    finish_reason=output.finish_reason, stop_token_id=output.stop_token_id,
                    embedding=output.embedding,
                ))
        finished = request.finished
        if not changed or (request.output_kind == OutputKind.FINAL_ONLY and not finished):
            return None
        if request.output_kind == OutputKind.FINAL_ONLY:  # the one message: every completion, whole
            last = {c.index: c for c in changed}
            changed = [CompletionOutput(index=i, text="", token_ids=c.token_ids, logprobs=c.logprobs,
                                        finish_reason=last[i].finish_reason if i in last else None,
                                        stop_token_id=last[i].stop_token_id if i in last else None)
                       for i, c in enumerate(request.completions)]
        prompt_logprobs = [] if delta and request.sent_prompt_logprobs else list(request.prompt_logprobs)
        request.sent_prompt_logprobs = request.sent_prompt_logprobs or bool(request.prompt_logprobs)
        usage = None
        if finished:
            usage = Usage(request.num_prompt_tokens, sum(len(c.token_ids) for c in request.completions),
                          request.num_cached_tokens)
        return RequestOutput(request_id, changed, num_prompt_tokens=request.num_prompt_tokens,
                             prompt_logprobs=prompt_logprobs, usage=usage, finished=finished)

    def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_names: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run a batch to completion; one whole RequestOutput per prompt, in prompt order (completions by index).
        `lora_names`: one adapter for every prompt, or one each (None: the base model)."""
        if not isinstance(lora_names, list):
            lora_names = [lora_names] * len(prompts)
        if len(lora_names) != len(prompts):
            raise ValueError(f"got {len(lora_names)} lora_names for {len(prompts)} prompts: give one or one each")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts: give one or one each"
            )
        request_ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, params, lora_name in zip(request_ids, prompts, sampling_params, lora_names):
            self.add_request(request_id, prompt, params, lora_name=lora_name)
        kinds = dict(zip(request_ids, (params.output_kind for params in sampling_params)))
        collected: dict[str, RequestOutput] = {}
        while any(not (request_id in collected and collected[request_id].finished) for request_id in request_ids):
            for output in self.step():
                if output.request_id not in kinds:
                    continue
                if output.request_id in collected:
                    collected[output.request_id].merge(output, aggregate=kinds[output.request_id] == OutputKind.DELTA)
                else:
                    collected[output.request_id] = output
        for output in collected.values():
            output.completions.sort(key=lambda c: c.index)
        return [collected[request_id] for request_id in request_ids]
