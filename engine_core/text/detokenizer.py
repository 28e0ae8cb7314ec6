"""Incremental detokenization with stop strings (vLLM v1's IncrementalDetokenizer), for both the frontend
and the offline LLMEngine.

Text grows one DecodeStream step per token. Stop strings are searched only in the
text that is new plus the tail a stop string could straddle; while a stream is
running, the last max(len(stop)) - 1 characters are held back so that no client
ever sees half a stop string that is later cut off.
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine_core.protocol import EngineCoreOutput, SamplingParams, TokenLogprobs


class Detokenizer:
    """One completion's text, built token by token."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold_back = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop else 0
        self.text = ""
        self.num_tokens = 0
        self.num_kept = 0  # of the last update's tokens, those up to the one that completed its stop string (or all)
        self.sent_offset = 0  # characters already handed out as deltas

    def update(self, new_token_ids: list[int], skip_last: bool = False) -> str | None:
        """Append tokens; return the stop string that matched (the text is then truncated), if any.

        skip_last: the last token is a stop token (EOS) whose text is not shown.
        """
        check_from = len(self.text)
        self.num_kept = len(new_token_ids)
        ends = []  # the text's length after each token
        for i, token_id in enumerate(new_token_ids):
            self.num_tokens += 1
            if skip_last and i == len(new_token_ids) - 1:
                break
            self.text += self.stream.step(self.tokenizer, token_id) or ""
            ends.append(len(self.text))
            if self.num_tokens <= self.min_tokens:  # stop strings count only after min_tokens
                check_from = len(self.text)
        if not self.stop or check_from == len(self.text):
            return None
        match = find_stop(self.text, check_from, self.stop)
        if match is None:
            return None
        stop, start = match
        self.num_kept = next(i + 1 for i, end in enumerate(ends) if end >= start + len(stop))
        self.text = self.text[:start + len(stop)] if self.include_stop else self.text[:start]
        return stop

    def cut(self, output: EngineCoreOutput) -> EngineCoreOutput:
        """`output` without the tokens after the one that completed the stop string its update found: a step may
        emit several tokens (speculative decoding), and those past a stop are not the completion's."""
        if self.num_kept >= len(output.new_token_ids):
            return output
        logprobs = output.new_logprobs[:self.num_kept] if output.new_logprobs else output.new_logprobs
        return replace(output, new_token_ids=output.new_token_ids[:self.num_kept], new_logprobs=logprobs,
                       stop_token_id=None)

    def next_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: new text (delta) or all of it, minus the held-back tail."""
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, self.sent_offset)
        if not delta:
            return self.text[:end]
        start, self.sent_offset = self.sent_offset, end
        return self.text[start:end]


def find_stop(text: str, check_from: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The stop string occurrence that ends first among those ending after `check_from`.

    Returns (stop, start index). On a tie the longer one wins (it starts earlier).
    """
    best = None
    for stop in stops:
        start = text.find(stop, max(0, check_from - len(stop) + 1))
        if start < 0:
            continue
        key = (start + len(stop), start)
        if best is None or key < best[0]:
            best = (key, stop, start)
    return None if best is None else (best[1], best[2])


def decode_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs] | None) -> list[TokenLogprobs]:
    """Fill in each entry's token texts (decoded one token at a time, specials kept); [] for None."""
    if not entries:
        return []
    for entry in entries:
        entry.decoded = [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in entry.token_ids]
    return entries
