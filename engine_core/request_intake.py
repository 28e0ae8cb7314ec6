"""How a request comes into the engine core, before any step sees it: checked once at the engine's trust
boundary (`check_request`, which EngineCore.validate_request and add_request call), then made the engine's
own Request (`to_request`). A step reads only the Request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.protocol import EngineCoreRequest, validate_sampling_params
from engine_core.request import Request

if TYPE_CHECKING:
    from engine_core.structured.masks import StructuredOutputs


def check_request(request: EngineCoreRequest, *, max_model_len: int, vocab_size: int,
                  structured: StructuredOutputs) -> None:
    """Raise ValueError (naming the problem) if the engine would refuse this request (its adapter aside:
    EngineCore.validate_lora)."""
    num_tokens = len(request.prompt_token_ids)
    if num_tokens == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if num_tokens >= max_model_len:
        what, why = ("input", "to be embedded") if request.pooling else ("prompt", "so one can be generated")
        raise ValueError(
            f"the {what} has {num_tokens} tokens but max_model_len is {max_model_len}: "
            f"shorten it to at most {max_model_len - 1} tokens {why}"
        )
    bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range: the vocabulary has {vocab_size} tokens")
    params = validate_sampling_params(request.sampling_params, vocab_size=vocab_size)
    if params.n != 1:
        raise ValueError(f"n must be 1 at the engine core (fan n > 1 out first, as the frontend does), "
                         f"got {params.n}")
    if params.structured is not None:
        structured.new_matcher(params.structured)  # compiles (and caches) or raises


def to_request(
    req: EngineCoreRequest, *, block_size: int,
    eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
) -> Request:
    """The engine's own Request for a checked EngineCoreRequest."""
    return Request(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=req.sampling_params,
        block_size=block_size,
        eos_token_ids=eos_token_ids,
        arrival_time=req.arrival_time,
        priority=req.priority,
        max_model_len=max_model_len,
        pooling=req.pooling,
        lora_name=req.lora_name,
    )
