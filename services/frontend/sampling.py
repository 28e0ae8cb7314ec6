"""Sampling parameters: the proto's optional fields validated, with defaults applied here and only here.

proto3's zero is not a default (temperature 0 is greedy, top_p 0 is invalid), so every
scalar is `optional` on the wire and `validate_sampling` decides what unset means.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from services.frontend.errors import InvalidRequest
from services.frontend.limits import RequestLimits

MAX_LOGPROBS = 20


class OutputKind(enum.IntEnum):
    """How a stream reports text (same numbers as tandem.v1.OutputKind)."""

    DELTA = 1
    CUMULATIVE = 2
    FINAL_ONLY = 3


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters, every default applied."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (-1 on the wire means the same)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to max_model_len (the input processor fills it in)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.DELTA

    def for_child(self, index: int) -> SamplingParams:
        """The params of child `index` of an n > 1 fan-out (seeded children get seed + index, as in vLLM)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def validate_sampling(proto, *, vocab_size: int, limits: RequestLimits = RequestLimits()) -> SamplingParams:
    """A tandem.v1.SamplingParams (or None) -> SamplingParams; raises InvalidRequest naming the field.

    `limits` caps n, max_tokens and the stop strings (see limits.py).
    """
    if proto is None:
        return SamplingParams()

    def get(name, default):
        return getattr(proto, name) if proto.HasField(name) else default

    max_n = limits.max_n
    n = _int("n", get("n", 1), 1, max_n, f"must be in [1, {max_n}] (the server's --max-n)")
    temperature = _float("temperature", get("temperature", 1.0), low=0.0, allowed="must be >= 0 (0 = greedy)")
    top_p = _float("top_p", get("top_p", 1.0), low=0.0, high=1.0, low_open=True, allowed="must be in (0, 1]")
    top_k = get("top_k", 0)
    if top_k < -1:
        raise InvalidRequest(f"sampling_params.top_k must be -1 or 0 (off) or a positive integer, got {top_k}")
    min_p = _float("min_p", get("min_p", 0.0), low=0.0, high=1.0, allowed="must be in [0, 1]")
    max_tokens = get("max_tokens", None)
    if max_tokens is not None and limits.max_tokens is not None:
        _int("max_tokens", max_tokens, 1, limits.max_tokens,
             f"must be in [1, {limits.max_tokens}] (the server's --max-tokens)")
    elif max_tokens is not None:
        _int("max_tokens", max_tokens, 1, None, "must be >= 1 (or unset: up to max_model_len)")
    min_tokens = _int("min_tokens", get("min_tokens", 0), 0, None, "must be >= 0")
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(
            f"sampling_params.min_tokens must be <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}"
        )
    penalties = {
        name: _float(name, get(name, default), low=-2.0, high=2.0, allowed="must be in [-2, 2]")
        for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0))
    }
    repetition_penalty = _float(
        "repetition_penalty", get("repetition_penalty", 1.0), low=0.0, high=2.0, low_open=True,
        allowed="must be in (0, 2] (1 = off)",
    )
    for i, token_id in enumerate(proto.stop_token_ids):
        _token_id(f"stop_token_ids[{i}]", token_id, vocab_size)
    logit_bias = {}
    for token_id, bias in proto.logit_bias.items():
        _token_id("logit_bias key", token_id, vocab_size)
        logit_bias[token_id] = _float(f"logit_bias[{token_id}]", bias, low=-100.0, high=100.0,
                                      allowed="must be in [-100, 100]")
    logprobs = get("logprobs", None)
    prompt_logprobs = get("prompt_logprobs", None)
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            _int(name, value, 0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}] (or unset)")
    stop = tuple(proto.stop)
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(f"sampling_params.stop has {len(stop)} strings; at most {limits.max_stop_strings} are "
                             "allowed (the server's --max-stop-strings)")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"sampling_params.stop[{i}] is empty; stop strings must be non-empty")
        if len(s) > limits.max_stop_string_chars:
            raise InvalidRequest(f"sampling_params.stop[{i}] is {len(s)} characters long; at most "
                                 f"{limits.max_stop_string_chars} are allowed (the server's --max-stop-string-length)")
    kind = proto.output_kind
    if kind not in (0, *OutputKind):
        raise InvalidRequest(f"sampling_params.output_kind {kind} is not a known OutputKind (DELTA, CUMULATIVE, "
                             "FINAL_ONLY)")
    return SamplingParams(
        n=n, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p,
        seed=get("seed", None), max_tokens=max_tokens, min_tokens=min_tokens,
        stop_token_ids=tuple(proto.stop_token_ids), ignore_eos=get("ignore_eos", False),
        repetition_penalty=repetition_penalty, logit_bias=logit_bias, **penalties,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop=stop,
        include_stop_str_in_output=get("include_stop_str_in_output", False),
        skip_special_tokens=get("skip_special_tokens", True),
        output_kind=OutputKind(kind) if kind else OutputKind.DELTA,
    )


# ---- checks -----------------------------------------------------------------------
def _int(name: str, value: int, low: int | None, high: int | None, allowed: str) -> int:
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequest(f"sampling_params.{name} {allowed}, got {value}")
    return value


def _float(name: str, value: float, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, allowed: str) -> float:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if not math.isfinite(value) or too_low or too_high:
        raise InvalidRequest(f"sampling_params.{name} {allowed}, got {value:g}")
    return value


def _token_id(name: str, token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise InvalidRequest(
            f"sampling_params.{name} {token_id} is not in the vocabulary (ids 0..{vocab_size - 1})"
        )
