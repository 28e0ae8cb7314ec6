"""Benchmark prompts: a seeded synthetic generator and JSONL files.

Synthetic prompts are random English words. With a tokenizer (the server's Tokenize call)
each prompt is cut to exactly `input_len` tokens and carries both its token ids and their
text; without one, `input_len` counts words.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "the of and to in is was for on that with as by at from his her an it be are this which or had not but have "
    "river mountain city garden window letter morning evening silver golden quiet bright ancient modern music "
    "science history kitchen engine signal stream packet server client memory kernel token model answer question "
    "travel winter summer autumn spring forest ocean island bridge castle market library doctor teacher student "
    "painter farmer sailor pilot writer reader story chapter promise secret journey harbor valley desert storm"
).split()


@dataclass(frozen=True)
class BenchPrompt:
    """One request's prompt (text, token ids or both) and how many tokens it should generate."""

    text: str | None
    token_ids: tuple[int, ...] | None
    max_tokens: int

    @property
    def num_tokens(self) -> int | None:
        return len(self.token_ids) if self.token_ids is not None else None


Tokenize = Callable[[str], Sequence[int]]
Detokenize = Callable[[Sequence[int]], str]


def synthetic_prompts(count: int, input_len: int, output_len: int, seed: int = 0,
                      tokenize: Tokenize | None = None, detokenize: Detokenize | None = None) -> list[BenchPrompt]:
    """`count` distinct prompts of `input_len` tokens (with `tokenize`) or words (without)."""
    if count < 1 or input_len < 1 or output_len < 1:
        raise ValueError("count, input_len and output_len must be positive")
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"#{i}:"] + [rng.choice(WORDS) for _ in range(input_len)]  # distinct first word: no shared prefix
        text = " ".join(words)
        if tokenize is None:
            prompts.append(BenchPrompt(" ".join(words[:input_len]), None, output_len))
            continue
        ids = list(tokenize(text))
        while len(ids) < input_len:  # rare: very short tokens; add words until long enough
            text += " " + " ".join(rng.choice(WORDS) for _ in range(input_len))
            ids = list(tokenize(text))
        ids = ids[:input_len]
        prompts.append(BenchPrompt(detokenize(ids) if detokenize else None, tuple(ids), output_len))
    return prompts


def jsonl_prompts(path: str | Path, default_max_tokens: int, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file: one object per line with "prompt" (text) or "token_ids", and
    optionally "max_tokens"."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        text, ids = item.get("prompt"), item.get("token_ids")
        if not isinstance(item, dict) or (text is None) == (ids is None):
            raise ValueError(f'{path}:{number}: give exactly one of "prompt" (a string) or "token_ids" (a list)')
        if text is not None and not isinstance(text, str):
            raise ValueError(f'{path}:{number}: "prompt" must be a string')
        if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise ValueError(f'{path}:{number}: "token_ids" must be a list of integers')
        max_tokens = item.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f'{path}:{number}: "max_tokens" must be a positive integer')
        prompts.append(BenchPrompt(text, tuple(ids) if ids is not None else None, max_tokens))
        if limit is not None and len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts in the file")
    return prompts


def repeat_to(prompts: list[BenchPrompt], count: int) -> list[BenchPrompt]:
    """Cycle through `prompts` until there are `count` of them."""
    return [prompts[i % len(prompts)] for i in range(count)]
