"""Protos <-> the protocol's types (engine_core/protocol/): the only module of the engine service that touches
generated classes.

Inputs: `EngineCoreInput` -> `busy_loop_items.Add | Abort` or a `UtilityCall` (its call mapped by name: each arm of
UtilityCall.call is the protocol class of its message's name, with the same fields); ValueError only when it cannot
convert (the request's own checks are `EngineCore.add_request`'s, once). Outputs: `EngineCoreOutputs` -> proto;
`EngineInfo` -> proto. The protocol's enums are numbered like tandem.v1's, so they cross as ints.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import typing

from tandem.v1 import common_pb2, engine_core_pb2

from engine_core.config import EngineConfig
from engine_core.protocol import (
    ControlCall,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineState,
    LoraInfo,
    PoolingParams,
    PoolingType,
    RequestError,
    SchedulerStats,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from services import sampling_convert
from services.engine.busy_loop_items import Abort, Add

logger = logging.getLogger(__name__)


# ---- inputs ---------------------------------------------------------------------------
def input_from_proto(message: engine_core_pb2.EngineCoreInput) -> Add | Abort | UtilityCall:
    """One stream input as a plain item; ValueError (with a message for the client) if it does not convert."""
    kind = message.WhichOneof("kind")
    if kind == "add":
        return Add(request_from_proto(message.add))
    if kind == "abort":
        return Abort(list(message.abort.request_ids))
    if kind == "utility":
        return utility_from_proto(message.utility)
    raise ValueError("EngineCoreInput has none of add, abort or utility set")


def refusal(message: engine_core_pb2.EngineCoreInput, error: str) -> EngineCoreOutputs:
    """The answer to an input that did not convert: a failed UtilityResult or a RequestError."""
    if message.WhichOneof("kind") == "utility":
        return EngineCoreOutputs(utility_result=UtilityResult(message.utility.call_id, False, error))
    return EngineCoreOutputs(errors=[RequestError(message.add.request_id, error)])


def request_from_proto(request: engine_core_pb2.EngineCoreRequest) -> EngineCoreRequest:
    if not request.request_id:
        raise ValueError("request_id must not be empty")
    return EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=sampling_convert.sampling_params_from_proto(request.sampling_params),
        arrival_time=request.arrival_time,
        priority=request.priority,
        trace_headers=dict(request.trace_headers) or None,
        pooling=pooling_from_proto(request.pooling) if request.HasField("pooling") else None,
        lora_name=request.lora_name or None,
    )


def pooling_from_proto(params: engine_core_pb2.PoolingParams) -> PoolingParams:
    if params.type not in (0, *PoolingType):
        raise ValueError(f"unknown pooling type {params.type}")
    return PoolingParams(PoolingType(params.type or PoolingType.LAST), normalize=params.normalize)


def utility_from_proto(call: engine_core_pb2.UtilityCall) -> UtilityCall:
    """The typed call of `call`'s arm of UtilityCall.call; without one, the deprecated form (`method` and its
    arguments in UtilityCall's own fields), still accepted for one release."""
    arm = call.WhichOneof("call")
    message = getattr(call, arm) if arm is not None else _arm_of_deprecated(call)
    return UtilityCall(call.call_id, control_call_from_proto(message))


def control_call_from_proto(message) -> ControlCall:
    """An arm's message as its protocol class (same name, same fields); an enum's unset 0 takes the default."""
    cls = _CONTROL_CALLS[message.DESCRIPTOR.name]
    fields = {}
    for field in dataclasses.fields(cls):
        value, kind = getattr(message, field.name), _FIELD_TYPES[cls][field.name]
        if isinstance(kind, type) and issubclass(kind, enum.IntEnum):
            if value not in (0, *kind):
                raise ValueError(f"unknown {field.name} {value}")
            if value == 0:
                continue  # unset: the dataclass's default
            value = kind(value)
        fields[field.name] = value
    return cls(**fields)


_CONTROL_CALLS = {cls.__name__: cls for cls in typing.get_args(ControlCall)}
_FIELD_TYPES = {cls: typing.get_type_hints(cls) for cls in _CONTROL_CALLS.values()}
_ARMS = [field.name for field in engine_core_pb2.UtilityCall.DESCRIPTOR.oneofs_by_name["call"].fields]


def _arm_of_deprecated(call: engine_core_pb2.UtilityCall):
    """The arm a deprecated UtilityCall means: the one named like its `method`, filled from UtilityCall's own
    fields of the same names (`pause_mode`, `profile_dir`, `lora_name`, `lora_path`)."""
    if call.method not in {int(method) for method in UtilityMethod}:
        unknown = f" and its deprecated method {call.method} is none" if call.method else ""
        raise ValueError(f"UtilityCall sets no arm of call ({', '.join(_ARMS)}){unknown}")
    method = UtilityMethod(call.method)
    _warn_deprecated(method)
    message = getattr(engine_core_pb2.UtilityCall(), str(method))
    for field in message.DESCRIPTOR.fields:
        setattr(message, field.name, getattr(call, field.name))
    return message


@functools.cache
def _warn_deprecated(method: UtilityMethod) -> None:
    """Once per method and process: the frontend that sent it is older than UtilityCall.call."""
    logger.warning("a frontend sent a deprecated utility call (UtilityCall.method %s), accepted until the next "
                   "release: upgrade it to one that sets UtilityCall.%s", method.name, method)


# ---- outputs --------------------------------------------------------------------------
def outputs_to_proto(message: EngineCoreOutputs) -> engine_core_pb2.EngineCoreOutputs:
    proto = engine_core_pb2.EngineCoreOutputs(
        outputs=[output_to_proto(output) for output in message.outputs],
        finished_request_ids=list(message.finished_request_ids),
        timestamp=message.timestamp,
        errors=[engine_core_pb2.RequestError(request_id=e.request_id, message=e.message, kind=int(e.kind))
                for e in message.errors],
    )
    if message.scheduler_stats is not None:
        proto.scheduler_stats.CopyFrom(stats_to_proto(message.scheduler_stats))
    if message.utility_result is not None:
        proto.utility_result.CopyFrom(utility_result_to_proto(message.utility_result))
    if message.kv_events is not None:
        events = message.kv_events
        proto.kv_events.CopyFrom(engine_core_pb2.KVCacheEvents(
            cleared=events.cleared, stored_block_hashes=events.stored, removed_block_hashes=events.removed,
            stored_lora_blocks=[engine_core_pb2.LoraBlockHashes(lora_name=name, block_hashes=hashes)
                                for name, hashes in events.stored_lora.items()]))
    if message.engine_state is not None:
        proto.engine_state.CopyFrom(engine_state_to_proto(message.engine_state))
    return proto


def engine_state_to_proto(state: EngineState) -> engine_core_pb2.EngineState:
    return engine_core_pb2.EngineState(paused=state.paused, asleep=state.asleep, pause_mode=int(state.pause_mode or 0),
                                       lora_names=state.lora_names)


def output_to_proto(output: EngineCoreOutput) -> engine_core_pb2.EngineCoreOutput:
    proto = engine_core_pb2.EngineCoreOutput(
        request_id=output.request_id,
        new_token_ids=output.new_token_ids,
        new_logprobs=[sampling_convert.logprobs_to_proto(lp) for lp in output.new_logprobs or ()],
        new_prompt_logprobs=[sampling_convert.logprobs_to_proto(lp) for lp in output.new_prompt_logprobs or ()],
        num_cached_tokens=output.num_cached_tokens,
    )
    if output.finish_reason is not None:
        proto.finish_reason = sampling_convert.finish_reason_to_proto(output.finish_reason)
    if output.stop_token_id is not None:
        proto.stop_token_id = output.stop_token_id
    if output.embedding is not None:
        proto.embedding.extend(output.embedding)
    if output.events:
        proto.events.extend(engine_core_pb2.EngineCoreEvent(type=int(e.type), timestamp=e.timestamp)
                            for e in output.events)
    return proto


def stats_to_proto(stats: SchedulerStats) -> engine_core_pb2.SchedulerStats:
    return engine_core_pb2.SchedulerStats(**dataclasses.asdict(stats))  # same field names


def utility_result_to_proto(result: UtilityResult) -> engine_core_pb2.UtilityResult:
    proto = engine_core_pb2.UtilityResult(call_id=result.call_id, ok=result.ok, error=result.error,
                                          error_kind=int(result.error_kind or 0),
                                          loras=[lora_to_proto(info) for info in result.loras])
    if result.stats is not None:
        proto.stats.CopyFrom(stats_to_proto(result.stats))
    return proto


def lora_to_proto(info: LoraInfo) -> common_pb2.LoraAdapter:
    return common_pb2.LoraAdapter(name=info.name, path=info.path, rank=info.rank, alpha=info.alpha,
                                  target_modules=info.target_modules, pinned=info.pinned, location=info.location)


def engine_info_to_proto(info: EngineInfo, config: EngineConfig) -> engine_core_pb2.GetEngineInfoResponse:
    return engine_core_pb2.GetEngineInfoResponse(
        **dataclasses.asdict(info),  # same field names; bos_token_id None stays unset
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
    )


def engine_info_from_bytes(data: bytes) -> engine_core_pb2.GetEngineInfoResponse:
    """The engine process's GetEngineInfo answer, as it crosses to the server process (processes/socket_pair.py)."""
    return engine_core_pb2.GetEngineInfoResponse.FromString(data)
