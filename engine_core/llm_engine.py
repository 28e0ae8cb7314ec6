"""The offline engine: vLLM's LLMEngine API over an in-process EngineCore.

Token ids in, token ids out. `n > 1` fans out into child requests that share the
prompt (and so its prefix-cache blocks); their outputs come back together under
the parent's id with `index` telling them apart.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.lora.info import LoraInfo
from engine_core.sampling_params import SamplingParams, validate_sampling_params
from engine_core.types import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)  # everything generated so far
    new_token_ids: list[int] = field(default_factory=list)  # generated in the last step
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs] | None = None  # entry i: prompt token i + 1
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.engine_core = EngineCore(config or EngineConfig())
        self._outputs: dict[str, RequestOutput] = {}  # parent request id -> its output
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
        """`lora_name`: a loaded LoRA adapter to run the request with (None: the base model)."""
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        params = validate_sampling_params(sampling_params or SamplingParams())
        arrival = time.time()
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            child_params = params if params.n == 1 else params.for_child(index)
            children.append(EngineCoreRequest(child_id, list(prompt_token_ids), child_params, arrival, priority,
                                              lora_name=lora_name))
        for child in children:  # validate all before queueing any
            self.engine_core.validate_request(child)
        for index, child in enumerate(children):
            self.engine_core.add_request(child)
            self._children[child.request_id] = (request_id, index)
        self._outputs[request_id] = RequestOutput(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            outputs=[CompletionOutput(index=i) for i in range(params.n)],
            arrival_time=arrival,
        )

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
            self._outputs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._outputs)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that made progress (finished ones last seen here)."""
        engine_outputs = self.engine_core.step()
        now = time.time()
        touched: dict[str, RequestOutput] = {}
        for output in engine_outputs.outputs:
            parent_id, index = self._children[output.request_id]
            request_output = self._outputs[parent_id]
            if parent_id not in touched:  # new_token_ids says what this step added, per completion
                for completion in request_output.outputs:
                    completion.new_token_ids = []
                touched[parent_id] = request_output
            self._apply(request_output.outputs[index], request_output, output, now)
            if output.finished:
                del self._children[output.request_id]
        for request_id, request_output in touched.items():
            if request_output.finished:
                request_output.finished_time = now
                del self._outputs[request_id]
        return list(touched.values())

    @staticmethod
    def _apply(
        completion: CompletionOutput, request_output: RequestOutput, output: EngineCoreOutput, now: float
    ) -> None:
        completion.new_token_ids = output.new_token_ids
        completion.token_ids.extend(output.new_token_ids)
        if output.new_logprobs:
            completion.logprobs = completion.logprobs or []
            completion.logprobs.extend(output.new_logprobs)
        if output.new_prompt_logprobs and completion.index == 0:
            request_output.prompt_logprobs = request_output.prompt_logprobs or []
            request_output.prompt_logprobs.extend(output.new_prompt_logprobs)
        if output.new_token_ids and request_output.first_token_time is None:
            request_output.first_token_time = now
        completion.finish_reason = output.finish_reason
        completion.stop_reason = output.stop_reason
        request_output.num_cached_tokens = output.num_cached_tokens

    def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_names: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run a batch to completion; outputs in prompt order. `lora_names`: one adapter for every
        prompt, or one each (None: the base model)."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts: give one or one each"
            )
        if not isinstance(lora_names, list):
            lora_names = [lora_names] * len(prompts)
        if len(lora_names) != len(prompts):
            raise ValueError(f"got {len(lora_names)} lora_names for {len(prompts)} prompts: give one or one each")
        request_ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, params, lora_name in zip(request_ids, prompts, sampling_params, lora_names):
            self.add_request(request_id, prompt, params, lora_name=lora_name)
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while wanted - finished.keys():
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]
