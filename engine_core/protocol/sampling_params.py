"""A request's sampling parameters and its output kind, torch-free and shared by both sides; the enum is
numbered like tandem.v1 (common.proto), so it crosses the wire as is.

`SamplingParams` only normalises on construction; `validate_sampling_params` checks every range
once, where a request enters (the frontend's input processor, the engine's gRPC edge, the
offline `LLMEngine`), and compiles a structured-output constraint (llguidance, no torch) so a bad
one is refused with the compiler's message. What only the engine knows (vocabulary, context
length) it checks itself.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from engine_core.protocol.structured_output import StructuredOutput, check_structured_output

_GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20


class OutputKind(enum.IntEnum):
    """How a stream reports text (tandem.v1.OutputKind)."""

    DELTA = 1  # every message carries only what is new
    CUMULATIVE = 2  # every message carries all text so far
    FINAL_ONLY = 3  # one message at the end


_OUTPUT_KIND_VALUES = frozenset(int(kind) for kind in OutputKind)




@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters (vLLM's SamplingParams); defaults are the wire's defaults, but for the
    output kind, which each API chooses."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (-1 means the same and is normalised to 0)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to max_model_len
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-N logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    # Used by the frontend; the engine core carries them unread.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # None: the API's own default, as in vLLM: DELTA on the wire and in AsyncLLM, CUMULATIVE in the offline
    # LLMEngine, FINAL_ONLY in LLM.generate
    output_kind: OutputKind | None = None
    structured: StructuredOutput | None = None  # constrain the output (None: free text)
    clamp_max_tokens: bool = False  # max_tokens beyond the context's room: cut to it (else refused)
    # False: never speculate for this request; True: as the engine does (--speculative-method; same output either way)
    speculative: bool = True

    def __post_init__(self) -> None:
        """Normalise containers (never validates: that is validate_sampling_params' job)."""
        set_ = object.__setattr__
        if self.top_k == -1:
            set_(self, "top_k", 0)
        set_(self, "stop_token_ids", tuple(self.stop_token_ids))
        set_(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        set_(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.output_kind in _OUTPUT_KIND_VALUES:
            set_(self, "output_kind", OutputKind(self.output_kind))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_child(self, index: int) -> SamplingParams:
        """The params of child `index` of an n > 1 fan-out (seeded children get seed + index, as in vLLM)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def validate_sampling_params(params: SamplingParams, *, vocab_size: int | None = None) -> SamplingParams:
    """Check every field's range; ValueError naming the field, its value and what is allowed.

    A server's own caps (the frontend's --max-* flags) are the frontend's to check, before this.

    Returns `params`. Token ids (stop_token_ids, logit_bias keys) are checked against
    `vocab_size` when given, else only to be >= 0.
    """
    _int("n", params.n, 1, None, "must be >= 1")
    _float("temperature", params.temperature, low=0.0, allowed="must be >= 0 (0 = greedy)")
    _float("top_p", params.top_p, low=0.0, high=1.0, low_open=True, allowed="must be in (0, 1]")
    _int("top_k", params.top_k, 0, None, "must be -1 or 0 (off) or a positive integer")
    _float("min_p", params.min_p, low=0.0, high=1.0, allowed="must be in [0, 1]")
    if params.seed is not None:
        _int("seed", params.seed, -(2**63), 2**64 - 1, "must fit in 64 bits")
    if params.max_tokens is not None:
        _int("max_tokens", params.max_tokens, 1, None, "must be >= 1 (or unset: up to max_model_len)")
    _int("min_tokens", params.min_tokens, 0, None, "must be >= 0")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={params.min_tokens}, "
                         f"max_tokens={params.max_tokens}")
    for i, token_id in enumerate(params.stop_token_ids):
        _token_id(f"stop_token_ids[{i}]", token_id, vocab_size)
    for name in ("presence_penalty", "frequency_penalty"):
        _float(name, getattr(params, name), low=-2.0, high=2.0, allowed="must be in [-2, 2]")
    _float("repetition_penalty", params.repetition_penalty, low=0.0, high=2.0, low_open=True,
           allowed="must be in (0, 2] (1 = off)")
    for token_id, bias in params.logit_bias.items():
        _token_id("logit_bias key", token_id, vocab_size)
        _float(f"logit_bias[{token_id}]", bias, low=-100.0, high=100.0, allowed="must be in [-100, 100]")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            _int(name, getattr(params, name), 0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}] (or unset)")
    for i, stop in enumerate(params.stop):
        if not isinstance(stop, str) or not stop:
            raise ValueError(f"stop[{i}] is empty; stop strings must be non-empty, got {stop!r}")
    if params.output_kind is not None and not isinstance(params.output_kind, OutputKind):  # see __post_init__
        raise ValueError(f"output_kind must be one of {', '.join(k.name for k in OutputKind)}, "
                         f"got {params.output_kind!r}")
    if params.structured is not None:
        check_structured_output(params.structured)
    return params


# ---- checks -----------------------------------------------------------------------
def _token_id(name: str, token_id, vocab_size: int | None) -> None:
    if vocab_size is None:
        _int(name, token_id, 0, None, "must be a token id >= 0")
    elif isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
        raise ValueError(f"{name} {token_id} is not in the vocabulary (ids 0..{vocab_size - 1})")


def _int(name: str, value, low: int | None, high: int | None, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} {allowed}, got {value}")
    return value


def _float(name: str, value, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if not math.isfinite(value) or too_low or too_high:
        raise ValueError(f"{name} {allowed}, got {value:g}")
    return value
