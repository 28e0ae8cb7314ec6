"""Per-request sampling parameters, validated on construction.

Mirrors vLLM's `SamplingParams`: the engine core uses the sampling fields; the
frontend-only fields (stop strings, output kind, detokenization switches) are
carried through unchanged so one object describes the whole request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPSILON = 1e-5


class RequestOutputKind(enum.IntEnum):
    """How the frontend streams a request's output to its client."""

    CUMULATIVE = 0  # every message carries all text so far
    DELTA = 1  # every message carries only what is new
    FINAL_ONLY = 2  # one message at the end


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-N logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    # Carried for the frontend; the engine core ignores these.
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    # ---- validation -------------------------------------------------------------
    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_float("temperature", self.temperature, low=0.0, allowed="must be >= 0 (0 = greedy)")
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True, allowed="must be in (0, 1]")
        _check_int("top_k", self.top_k, low=0, allowed="must be -1 or 0 (disabled) or a positive integer")
        _check_float("min_p", self.min_p, low=0.0, high=1.0, allowed="must be in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, allowed="must be >= 1 (or unset for no limit)")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        for i, token_id in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token_id, low=0, allowed="must be a token id >= 0")
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0, allowed="must be in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0, allowed="must be in [-2, 2]")
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, low_open=True,
            high=2.0, allowed="must be in (0, 2]",
        )
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias key", token_id, low=0, allowed="must be a token id >= 0")
            _check_float(f"logit_bias[{token_id}]", bias, low=-100.0, high=100.0, allowed="must be in [-100, 100]")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20, allowed="must be in [0, 20] (or unset)")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=20, allowed="must be in [0, 20] (or unset)")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(
                    f"output_kind must be one of {[k.name for k in RequestOutputKind]}, got {self.output_kind!r}"
                ) from None


def _check_int(name: str, value, *, low: int | None = None, high: int | None = None, allowed: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        allowed = allowed or _range_text(low, high)
        raise ValueError(f"{name} {allowed}, got {value}")


def _check_float(
    name: str, value, *, low: float | None = None, high: float | None = None,
    low_open: bool = False, allowed: str = "",
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if not math.isfinite(value) or too_low or too_high:
        allowed = allowed or _range_text(low, high)
        raise ValueError(f"{name} {allowed}, got {value}")


def _range_text(low, high) -> str:
    if low is not None and high is not None:
        return f"must be in [{low}, {high}]"
    if low is not None:
        return f"must be >= {low}"
    return f"must be <= {high}"
