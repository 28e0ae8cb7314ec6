"""One request of the offline LLMEngine: its completions' progress, detokenized with stop strings, and the
RequestOutput each engine step gives the caller, per output kind (the offline twin of the frontend's
OutputProcessor, which sits across gRPC from the engine; both detokenize with engine_core.text.detokenizer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from engine_core.protocol import (
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    Usage,
)
from engine_core.text.detokenizer import Detokenizer, decode_logprobs


@dataclass
class OfflineCompletion:
    """One child's progress, kept whole whatever the output kind."""

    detokenizer: Detokenizer | None  # None: the engine has no tokenizer, text stays empty
    include_stop: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float | None = None  # None unless logprobs were asked
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    embedding: list[float] | None = None  # a pooling request's vector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput, tokenizer: Tokenizer | None) -> tuple[bool, EngineCoreOutput]:
        """Take one step's news; True when a stop string ended the completion here (the engine must abort it), and
        the news as kept (none of its tokens past a stop string)."""
        finish = output.finish_reason
        stop_string = None
        if self.detokenizer is not None:
            skip_last = finish == FinishReason.STOP and output.stop_token_id is not None and not self.include_stop
            stop_string = self.detokenizer.update(output.new_token_ids, skip_last=skip_last)
            if stop_string is not None:
                output = self.detokenizer.cut(output)  # no token past the stop string's last
        self.token_ids.extend(output.new_token_ids)
        self.embedding = output.embedding if output.embedding is not None else self.embedding
        new_logprobs = decode_logprobs(tokenizer, output.new_logprobs) if tokenizer else list(output.new_logprobs or ())
        self.logprobs.extend(new_logprobs)
        if self.cumulative_logprob is not None:
            self.cumulative_logprob += sum(entry.logprobs[0] for entry in new_logprobs)
        if stop_string is not None:
            self.finish_reason, self.stop_string = FinishReason.STOP, stop_string
            return finish is None, output
        self.finish_reason = finish
        self.stop_token_id = output.stop_token_id if finish == FinishReason.STOP else None
        return False, output

    def message(self, index: int, kind: OutputKind, new: EngineCoreOutput | None) -> CompletionOutput:
        """This completion as the caller sees it now: what is new (DELTA, `new`'s tokens) or all of it."""
        delta = kind == OutputKind.DELTA
        text = "" if self.detokenizer is None else self.detokenizer.next_text(self.finished, delta)
        token_ids = list(new.new_token_ids) if delta and new is not None else list(self.token_ids)
        logprobs = self.logprobs[len(self.logprobs) - len(new.new_logprobs or ()):] if delta and new else self.logprobs
        return CompletionOutput(index=index, text=text, token_ids=token_ids, logprobs=list(logprobs),
                                finish_reason=self.finish_reason, stop_string=self.stop_string,
                                stop_token_id=self.stop_token_id, embedding=self.embedding,
                                cumulative_logprob=self.cumulative_logprob)


class OfflineRequest:
    """A caller's request: its n completions (one engine request each) and what it has sent."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None, child_params: list[SamplingParams]) -> None:
        self.request_id = request_id
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.output_kind = params.output_kind or OutputKind.CUMULATIVE  # vLLM's LLMEngine default
        self.tokenizer = tokenizer
        self.completions = [
            OfflineCompletion(None if tokenizer is None else Detokenizer(tokenizer, child),
                              child.include_stop_str_in_output,
                              cumulative_logprob=None if child.logprobs is None else 0.0)
            for child in child_params]
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.sent_prompt_logprobs = False
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def update(self, outputs: list[tuple[int, EngineCoreOutput]]) -> tuple[RequestOutput | None, list[int]]:
        """One step's outputs for this request, as (index, output): the message to give the caller (None:
        nothing, per the output kind) and the indexes a stop string ended (to abort in the engine)."""
        stopped, changed = [], []
        now = time.time()
        for index, output in outputs:
            completion = self.completions[index]
            if completion.finished:  # ended by a stop string while the engine still ran it
                continue
            stopped_here, output = completion.update(output, self.tokenizer)
            if stopped_here:
                stopped.append(index)
            if index == 0:
                self.prompt_logprobs.extend(decode_logprobs(self.tokenizer, output.new_prompt_logprobs)
                                            if self.tokenizer else output.new_prompt_logprobs or ())
            self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
            if output.new_token_ids:
                self.metrics.first_token_ts = self.metrics.first_token_ts or now
                self.metrics.last_token_ts = now
                self.metrics.num_generation_tokens += len(output.new_token_ids)
            if output.new_token_ids or completion.finished:
                changed.append((index, output))
        return self._message(changed), stopped

    def _message(self, changed: list[tuple[int, EngineCoreOutput]]) -> RequestOutput | None:
        finished = self.finished
        kind = self.output_kind
        if not changed or (kind == OutputKind.FINAL_ONLY and not finished):
            return None
        if kind == OutputKind.FINAL_ONLY:  # the one message: every completion, whole
            outputs = [c.message(i, kind, None) for i, c in enumerate(self.completions)]
        else:
            outputs = [self.completions[i].message(i, kind, new) for i, new in changed]
        delta = kind == OutputKind.DELTA
        prompt_logprobs = [] if delta and self.sent_prompt_logprobs else list(self.prompt_logprobs)
        self.sent_prompt_logprobs = self.sent_prompt_logprobs or bool(self.prompt_logprobs)
        usage = None
        if finished:
            usage = Usage(len(self.prompt_token_ids), sum(len(c.token_ids) for c in self.completions),
                          self.num_cached_tokens)
        return RequestOutput(self.request_id, outputs, num_prompt_tokens=len(self.prompt_token_ids),
                             prompt_logprobs=prompt_logprobs, usage=usage, finished=finished, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             metrics=RequestMetrics(**vars(self.metrics)))
