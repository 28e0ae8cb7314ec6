"""The only frontend module that maps between generated protos and the frontend's dataclasses."""

from __future__ import annotations

import dataclasses

from tandem.v1 import admin_pb2, common_pb2, engine_core_pb2, generation_pb2

from engine_core.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineState,
    KVCacheEvents,
    LoraInfo,
    PauseMode,
    PoolingParams,
    PoolingType,
    RequestError,
    RequestErrorKind,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    UtilityCall,
    UtilityErrorKind,
    UtilityResult,
)
from services import sampling_convert
from services.frontend.async_llm import EmbedResult
from services.frontend.engines.client import EngineCallResult, EngineStatus
from services.frontend.errors import InvalidRequest
from services.frontend.input_processor import ChatPrompt, Prompt, TextPrompt, TokensPrompt
from services.frontend.tools import convert as tool_convert


# ---- public API -> frontend ------------------------------------------------------
def prompt_from_generate(request: generation_pb2.GenerateRequest) -> Prompt | None:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return TextPrompt(request.text, add_special_tokens=add_special)
    if kind == "token_ids":
        return TokensPrompt(list(request.token_ids.ids))
    return None


def sampling_params_from_proto(proto: common_pb2.SamplingParams | None) -> SamplingParams:
    """Unset fields take the defaults; the input processor validates."""
    return sampling_convert.sampling_params_from_proto(proto)


def prompt_from_chat(request: generation_pb2.ChatRequest) -> ChatPrompt:
    return ChatPrompt(
        messages=[tool_convert.message_from_proto(m) for m in request.messages],
        add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        continue_final_message=request.continue_final_message,
        tools=tool_convert.tool_request_from_proto(request),
    )


def embed_from_proto(request: generation_pb2.EmbedRequest) -> tuple[list[Prompt | None], PoolingParams]:
    """The inputs (None: an input with neither text nor token ids) and how to pool them."""
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    prompts: list[Prompt | None] = []
    for item in request.inputs:
        kind = item.WhichOneof("input")
        prompts.append(TextPrompt(item.text, add_special_tokens=add_special) if kind == "text"
                       else TokensPrompt(list(item.token_ids.ids)) if kind == "token_ids" else None)
    if request.pooling not in (0, *PoolingType):
        raise InvalidRequest(f"pooling must be one of LAST, MEAN, CLS, got {request.pooling}")
    pooling = PoolingParams(PoolingType(request.pooling or PoolingType.LAST),
                            normalize=request.normalize if request.HasField("normalize") else True)
    return prompts, pooling


# ---- frontend -> public API ------------------------------------------------------
StreamResponse = generation_pb2.GenerateResponse | generation_pb2.ChatResponse


def response_from_output(output: RequestOutput, response_type: type[StreamResponse]) -> StreamResponse:
    """One stream message: a GenerateResponse or a ChatResponse (the same fields, one type per RPC)."""
    response = response_type(request_id=output.request_id, num_prompt_tokens=output.num_prompt_tokens)
    for c in output.completions:
        chunk = response.completions.add(index=c.index, text=c.text, token_ids=c.token_ids,
                                         finish_reason=sampling_convert.finish_reason_to_proto(c.finish_reason))
        tool_convert.add_tool_calls(chunk, c)
        chunk.logprobs.extend(sampling_convert.logprobs_to_proto(entry) for entry in c.logprobs)
        if c.stop_string is not None:
            chunk.stop_string = c.stop_string
        elif c.stop_token_id is not None:
            chunk.stop_token_id = c.stop_token_id
    response.prompt_logprobs.extend(sampling_convert.logprobs_to_proto(entry) for entry in output.prompt_logprobs)
    if output.usage is not None:
        response.usage.prompt_tokens = output.usage.prompt_tokens
        response.usage.completion_tokens = output.usage.completion_tokens
        response.usage.cached_tokens = output.usage.cached_tokens
    return response


def embed_response(result: EmbedResult) -> generation_pb2.EmbedResponse:
    response = generation_pb2.EmbedResponse(request_id=result.request_id, usage=generation_pb2.Usage(
        prompt_tokens=result.usage.prompt_tokens, cached_tokens=result.usage.cached_tokens))
    for index, (values, num_tokens) in enumerate(zip(result.embeddings, result.num_prompt_tokens)):
        response.embeddings.add(index=index, values=values, num_prompt_tokens=num_tokens)
    return response


def tokenize_response(token_ids: list[int], tokens: list[str], max_model_len: int) -> generation_pb2.TokenizeResponse:
    return generation_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokens, max_model_len=max_model_len)


def detokenize_response(text: str) -> generation_pb2.DetokenizeResponse:
    return generation_pb2.DetokenizeResponse(text=text)


def abort_response(aborted_request_ids: list[str]) -> generation_pb2.AbortResponse:
    return generation_pb2.AbortResponse(aborted_request_ids=aborted_request_ids)


def model_info_to_proto(info: EngineInfo, *, has_chat_template: bool) -> generation_pb2.GetModelInfoResponse:
    return generation_pb2.GetModelInfoResponse(
        model_name=info.model_name, model_path=info.model_path, max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids, has_chat_template=has_chat_template,
    )


def server_info_to_proto(version: str, num_in_flight: int, max_waiting_requests: int, engines: list[EngineStatus],
                         *, draining: bool, serving: bool) -> generation_pb2.GetServerInfoResponse:
    return generation_pb2.GetServerInfoResponse(
        version=version, num_in_flight=num_in_flight, max_waiting_requests=max_waiting_requests,
        engines=[generation_pb2.EngineStatus(
            address=e.address, connected=e.connected, num_in_flight=e.num_in_flight, paused=e.state.paused,
            pause_mode=int(e.state.pause_mode or 0), asleep=e.state.asleep) for e in engines],
        draining=draining, serving=serving,
    )


# ---- admin API <-> frontend ------------------------------------------------------
AdminResponse = (admin_pb2.PauseResponse | admin_pb2.ResumeResponse | admin_pb2.SleepResponse
                 | admin_pb2.WakeUpResponse | admin_pb2.ResetPrefixCacheResponse | admin_pb2.StartProfileResponse
                 | admin_pb2.StopProfileResponse)


def pause_mode_from_proto(mode: int) -> PauseMode:
    """A tandem.v1.PauseMode (unspecified: ABORT); InvalidRequest if unknown."""
    if mode not in (0, *PauseMode):
        raise InvalidRequest(f"mode {mode} is not a PauseMode (PAUSE_MODE_ABORT, PAUSE_MODE_WAIT or PAUSE_MODE_KEEP)")
    return PauseMode(mode or PauseMode.ABORT)


def admin_response(results: list[EngineCallResult], response_type: type[AdminResponse]) -> AdminResponse:
    """The engines' utility results as one (ok, detail) answer."""
    failed = [f"engine at {r.address}: {r.error}" for r in results if not r.ok]
    detail = "; ".join(failed) if failed else f"done on {len(results)} engine(s)"
    return response_type(ok=not failed, detail=detail)


def lora_from_proto(lora: common_pb2.LoraAdapter) -> LoraInfo:
    return LoraInfo(lora.name, lora.path, lora.rank, lora.alpha, tuple(lora.target_modules), lora.pinned,
                    lora.location)


def lora_to_proto(info: LoraInfo, engine: str) -> common_pb2.LoraAdapter:
    return common_pb2.LoraAdapter(name=info.name, path=info.path, rank=info.rank, alpha=info.alpha,
                                  target_modules=info.target_modules, pinned=info.pinned, location=info.location,
                                  engine=engine)


def lora_adapters(results: list[EngineCallResult]) -> list[common_pb2.LoraAdapter]:
    """Every engine's adapters, each named with its engine."""
    return [lora_to_proto(info, result.address) for result in results for info in result.loras]


def drain_response(left: int, timeout_s: float) -> admin_pb2.DrainResponse:
    detail = "drained" if not left else f"{left} requests still in flight after {timeout_s:g}s"
    return admin_pb2.DrainResponse(ok=not left, detail=detail)


# ---- frontend -> engine ----------------------------------------------------------
def request_to_proto(request: EngineCoreRequest) -> engine_core_pb2.EngineCoreInput:
    return engine_core_pb2.EngineCoreInput(add=engine_core_pb2.EngineCoreRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_convert.sampling_params_to_proto(request.sampling_params),
        arrival_time=request.arrival_time, priority=request.priority, trace_headers=request.trace_headers or {},
        lora_name=request.lora_name or "",
        pooling=None if request.pooling is None else engine_core_pb2.PoolingParams(
            type=int(request.pooling.pooling_type), normalize=request.pooling.normalize),
    ))


# ---- engine -> frontend ----------------------------------------------------------
def engine_info_from_proto(info: engine_core_pb2.GetEngineInfoResponse) -> EngineInfo:
    return EngineInfo(model_name=info.model_name, model_path=info.model_path, max_model_len=info.max_model_len,
                      vocab_size=info.vocab_size, eos_token_ids=tuple(info.eos_token_ids), block_size=info.block_size,
                      num_blocks=info.num_blocks,
                      bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
                      dtype=info.dtype, device=info.device, attention_backend=info.attention_backend,
                      lossy_linear_kernels=tuple(info.lossy_linear_kernels), batch_invariant=info.batch_invariant,
                      kv_cache_dtype=info.kv_cache_dtype)


def message_from_proto(batch: engine_core_pb2.EngineCoreOutputs) -> EngineCoreOutputs:
    """One message of the Connect stream: a step's outputs, refused requests, a utility call's answer, load,
    prefix-cache changes, the engine's state."""
    message = EngineCoreOutputs(
        outputs=[output_from_proto(o) for o in batch.outputs],
        finished_request_ids=set(batch.finished_request_ids),
        timestamp=batch.timestamp,
        errors=[RequestError(e.request_id, e.message, RequestErrorKind(e.kind)) for e in batch.errors],
    )
    if batch.HasField("utility_result"):
        result = batch.utility_result
        message.utility_result = UtilityResult(
            result.call_id, result.ok, result.error, loras=tuple(lora_from_proto(lora) for lora in result.loras),
            error_kind=UtilityErrorKind(result.error_kind) if result.error_kind in (*UtilityErrorKind,) else None)
    if batch.HasField("scheduler_stats"):
        stats = batch.scheduler_stats
        message.scheduler_stats = SchedulerStats(num_running_reqs=stats.num_running_reqs,
                                                 num_waiting_reqs=stats.num_waiting_reqs,
                                                 kv_cache_usage=stats.kv_cache_usage,
                                                 num_free_blocks=stats.num_free_blocks,  # a gateway's GetLoads
                                                 num_total_blocks=stats.num_total_blocks)
    if batch.HasField("kv_events"):
        events = batch.kv_events
        message.kv_events = KVCacheEvents(stored=list(events.stored_block_hashes),
                                          removed=list(events.removed_block_hashes), cleared=events.cleared,
                                          stored_lora={group.lora_name: list(group.block_hashes)
                                                       for group in events.stored_lora_blocks})
    if batch.HasField("engine_state"):
        state = batch.engine_state
        mode = PauseMode(state.pause_mode) if state.paused and state.pause_mode in (*PauseMode,) else None
        message.engine_state = EngineState(paused=state.paused, asleep=state.asleep, pause_mode=mode,
                                           lora_names=tuple(state.lora_names))
    return message


def output_from_proto(o: engine_core_pb2.EngineCoreOutput) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=o.request_id, new_token_ids=list(o.new_token_ids),
        new_logprobs=[sampling_convert.logprobs_from_proto(e) for e in o.new_logprobs] or None,
        new_prompt_logprobs=[sampling_convert.logprobs_from_proto(e) for e in o.new_prompt_logprobs] or None,
        finish_reason=sampling_convert.finish_reason_from_proto(o.finish_reason),
        stop_token_id=o.stop_token_id if o.HasField("stop_token_id") else None,
        num_cached_tokens=o.num_cached_tokens,
        events=[EngineCoreEvent(EngineCoreEventType(e.type), e.timestamp) for e in o.events] or None,
        embedding=list(o.embedding) or None,
    )


def abort_to_proto(request_ids: list[str]) -> engine_core_pb2.EngineCoreInput:
    return engine_core_pb2.EngineCoreInput(abort=engine_core_pb2.AbortRequests(request_ids=request_ids))


def engine_info_request() -> engine_core_pb2.GetEngineInfoRequest:
    return engine_core_pb2.GetEngineInfoRequest()


def utility_to_proto(utility: UtilityCall) -> engine_core_pb2.EngineCoreInput:
    """The call in its arm of UtilityCall.call: the arm whose message has the call's class name, with its fields
    (enums as their numbers)."""
    proto = engine_core_pb2.UtilityCall(call_id=utility.call_id)
    arm = getattr(proto, _ARM_OF_MESSAGE[type(utility.call).__name__])
    arm.SetInParent()  # an arm without fields is set too
    for field in dataclasses.fields(utility.call):
        setattr(arm, field.name, getattr(utility.call, field.name))
    return engine_core_pb2.EngineCoreInput(utility=proto)


_ARM_OF_MESSAGE = {field.message_type.name: field.name
                   for field in engine_core_pb2.UtilityCall.DESCRIPTOR.oneofs_by_name["call"].fields}
