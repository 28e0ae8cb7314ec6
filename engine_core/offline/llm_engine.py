"""The offline engine: vLLM's LLMEngine API over an in-process EngineCore.

As vLLM's, it owns the model's tokenizer and an incremental detokenizer: prompts are text, token ids or
vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}; each completion's `text` is filled and stop strings end
it. It yields the same RequestOutput as the frontend's AsyncLLM, per the request's output kind (CUMULATIVE
unless asked, as vLLM's LLMEngine: all so far; DELTA: each step's news; FINAL_ONLY: one message at the end).
`n > 1` fans out into child requests that share the prompt (and so its prefix-cache blocks), as the frontend
does; their outputs come back under the parent's id, told apart by `index`. LLM (engine_core/offline/llm.py) runs
batches to completion over it.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.offline.offline_request import OfflineRequest
from engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    LoraInfo,
    OutputKind,
    RequestOutput,
    SamplingParams,
)
from engine_core.startup import tokenizer_path
from engine_core.text.tokenizer import TokenizerBundle, load_tokenizer

if TYPE_CHECKING:
    from engine_core.engine_args import EngineArgs

# What add_request and generate take as a prompt, as vLLM's do
PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.engine_core = EngineCore(config or EngineConfig())
        self.engine_core.ready_to_serve()  # the first request runs warm (engine_core/readiness)
        path = tokenizer_path(self.engine_core.config, self.engine_core.model_path)
        # None: a model without a tokenizer (token ids in and out, text stays empty)
        self.tokenizer: TokenizerBundle | None = load_tokenizer(path) if path else None
        self._requests: dict[str, OfflineRequest] = {}  # parent request id -> its progress
        self._children: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's constructor: LLMEngine.from_engine_args(EngineArgs(model=...))."""
        return cls(engine_args.create_engine_config())

    @property
    def info(self):
        return self.engine_core.info

    def get_tokenizer(self) -> TokenizerBundle:
        if self.tokenizer is None:
            raise ValueError(_NO_TOKENIZER)
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """`prompt`: a str (tokenized with the model's tokenizer, BOS as the model asks), token ids, or vLLM's
        {"prompt": str} / {"prompt_token_ids": [...]}. Checked by `EngineCore.validate_request` (ValueError naming
        the problem) before anything is queued. `lora_name`: a loaded LoRA adapter to run the request with (None:
        the base model)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        params = sampling_params or SamplingParams()
        if isinstance(params.n, bool) or not isinstance(params.n, int) or params.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {params.n!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need the model's tokenizer: {_NO_TOKENIZER}")
        text, token_ids = self._tokenize(prompt)
        request = EngineCoreRequest(request_id, token_ids, params, time.time(), priority, lora_name=lora_name)
        children = request.fan_out()
        for child in children:  # validate all before queueing any
            self.engine_core.validate_request(child)
        for index, child in enumerate(children):
            self.engine_core.add_request(child)
            self._children[child.request_id] = (request_id, index)
        self._requests[request_id] = OfflineRequest(
            request_id, text, list(request.prompt_token_ids), params,
            None if self.tokenizer is None else self.tokenizer.tokenizer, [c.sampling_params for c in children])

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids)."""
        if isinstance(prompt, dict) and set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        elif isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            prompt = list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give some text or token ids")
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt is a str, a list of token ids, {{'prompt': str}} or {{'prompt_token_ids': "
                         f"[...]}}, got {type(prompt).__name__}: {prompt!r:.80}")

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
            parent = self._children.get(output.request_id)
            if parent is None:  # ended by a stop string in an earlier step
                continue
            parent_id, index = parent
            if output.finished:
                del self._children[output.request_id]
            news.setdefault(parent_id, []).append((index, output))
        results = []
        for parent_id, outputs in news.items():
            request = self._requests[parent_id]
            result, stopped = request.update(outputs)
            if stopped:  # a stop string ended these completions: the engine stops generating them
                child_ids = [child for child, (parent, index) in self._children.items()
                             if parent == parent_id and index in stopped]
                self.engine_core.abort_requests(child_ids)
                for child in child_ids:
                    del self._children[child]
            if request.finished:
                del self._requests[parent_id]
            if result is not None:
                results.append(result)
        return results

    def generate(
        self,
        prompts: list[PromptType],
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
            output.outputs.sort(key=lambda c: c.index)
        return [collected[request_id] for request_id in request_ids]


_NO_TOKENIZER = ("this engine has no tokenizer (the model folder has no tokenizer.json): give token ids, or set "
                 "EngineConfig.model.tokenizer to a tokenizer.json folder or a .gguf")
