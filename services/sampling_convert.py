"""Protos <-> the shared request protocol (engine_core/protocol/), for both services.

tandem.v1's enums carry the same numbers as OutputKind and FinishReason, so enums cross as ints;
every sampling scalar is `optional` on the wire and an unset one takes the dataclass default.
Conversion never validates: `validate_sampling_params` does, once, where a request enters.
"""

from __future__ import annotations

from tandem.v1 import common_pb2

from engine_core.protocol import FinishReason, SamplingParams, StructuredOutput, TokenLogprobs

# Optional scalars copied only when set: unset ones take the dataclass defaults.
_OPTIONAL_SCALARS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "clamp_max_tokens", "speculative",
)


def sampling_params_from_proto(proto: common_pb2.SamplingParams | None) -> SamplingParams:
    """Set fields only; output_kind stays the wire's int (validate_sampling_params checks it)."""
    if proto is None:
        return SamplingParams()
    kwargs: dict = {name: getattr(proto, name) for name in _OPTIONAL_SCALARS if proto.HasField(name)}
    if proto.output_kind:
        kwargs["output_kind"] = proto.output_kind
    if proto.HasField("structured"):
        kwargs["structured"] = structured_output_from_proto(proto.structured)
    return SamplingParams(stop_token_ids=tuple(proto.stop_token_ids), logit_bias=dict(proto.logit_bias),
                          stop=tuple(proto.stop), **kwargs)


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every scalar sent set, except the optional ones that are None."""
    proto = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias, stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        output_kind=int(params.output_kind or 0),  # 0: unset, the API's default
        clamp_max_tokens=params.clamp_max_tokens, speculative=params.speculative,
    )
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(proto, name, getattr(params, name))
    if params.structured is not None:
        proto.structured.CopyFrom(structured_output_to_proto(params.structured))
    return proto


def structured_output_from_proto(proto: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """The oneof's case; None when no case is set or json_object is false (no constraint)."""
    kind = proto.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not proto.json_object):
        return None
    value = tuple(proto.choice.options) if kind == "choice" else getattr(proto, kind)
    return StructuredOutput(whitespace_flexible=proto.whitespace_flexible, **{kind: value})


def structured_output_to_proto(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    """One constraint on the wire (a oneof holds one; validated params have exactly one)."""
    proto = common_pb2.StructuredOutput(whitespace_flexible=structured.whitespace_flexible)
    for kind in structured.constraints[:1]:
        if kind == "choice":
            proto.choice.options.extend(structured.choice)
        else:
            setattr(proto, kind, getattr(structured, kind))
    return proto


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """FINISH_REASON_UNSPECIFIED (0) -> None: not finished."""
    return FinishReason(value) if value else None


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return int(reason) if reason is not None else common_pb2.FINISH_REASON_UNSPECIFIED


def logprobs_from_proto(entry: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(list(entry.token_ids), list(entry.logprobs), entry.rank, list(entry.decoded))


def logprobs_to_proto(entry: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_ids=entry.token_ids, logprobs=entry.logprobs, rank=entry.rank,
                                    decoded=entry.decoded)
