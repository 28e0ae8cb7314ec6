"""The only frontend module that maps between generated protos and the frontend's dataclasses."""

from __future__ import annotations

from tandem.v1 import common_pb2, engine_core_pb2, generation_pb2

from services.frontend.input_processor import ChatPrompt, Prompt, TextPrompt, TokensPrompt
from services.frontend.messages import (
    EngineEvent,
    EngineEventType,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestOutput,
    TokenLogprobs,
)
from services.frontend.sampling import SamplingParams


# ---- public API -> frontend ------------------------------------------------------
def prompt_from_generate(request: generation_pb2.GenerateRequest) -> Prompt | None:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return TextPrompt(request.text, add_special_tokens=add_special)
    if kind == "token_ids":
        return TokensPrompt(list(request.token_ids.ids))
    return None


def prompt_from_chat(request: generation_pb2.ChatRequest) -> ChatPrompt:
    return ChatPrompt(
        messages=[{"role": m.role, "content": m.content} for m in request.messages],
        add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        continue_final_message=request.continue_final_message,
    )


# ---- frontend -> public API ------------------------------------------------------
StreamResponse = generation_pb2.GenerateResponse | generation_pb2.ChatResponse


def response_from_output(output: RequestOutput, response_type: type[StreamResponse]) -> StreamResponse:
    """One stream message: a GenerateResponse or a ChatResponse (the same fields, one type per RPC)."""
    response = response_type(request_id=output.request_id, num_prompt_tokens=output.num_prompt_tokens)
    for c in output.completions:
        chunk = response.completions.add(index=c.index, text=c.text, token_ids=c.token_ids,
                                         finish_reason=int(c.finish_reason or 0))
        chunk.logprobs.extend(logprobs_to_proto(entry) for entry in c.logprobs)
        if c.stop_string is not None:
            chunk.stop_string = c.stop_string
        elif c.stop_token_id is not None:
            chunk.stop_token_id = c.stop_token_id
    response.prompt_logprobs.extend(logprobs_to_proto(entry) for entry in output.prompt_logprobs)
    if output.usage is not None:
        response.usage.prompt_tokens = output.usage.prompt_tokens
        response.usage.completion_tokens = output.usage.completion_tokens
        response.usage.cached_tokens = output.usage.cached_tokens
    return response


def logprobs_to_proto(entry: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_ids=entry.token_ids, logprobs=entry.logprobs,
                                    rank=entry.rank, decoded=entry.decoded)


# ---- frontend -> engine ----------------------------------------------------------
def request_to_proto(request: EngineRequest) -> engine_core_pb2.EngineCoreInput:
    return engine_core_pb2.EngineCoreInput(add=engine_core_pb2.EngineCoreRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_to_proto(request.sampling_params), arrival_time=request.arrival_time,
        priority=request.priority, trace_headers=request.trace_headers,
    ))


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """Every default is already applied: all scalars are sent set (max_tokens always has a value here)."""
    proto = common_pb2.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, stop=p.stop,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        output_kind=int(p.output_kind),
    )
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            setattr(proto, name, getattr(p, name))
    return proto


# ---- engine -> frontend ----------------------------------------------------------
def engine_info_from_proto(info: engine_core_pb2.GetEngineInfoResponse) -> EngineInfo:
    return EngineInfo(model_name=info.model_name, model_path=info.model_path, max_model_len=info.max_model_len,
                      vocab_size=info.vocab_size, eos_token_ids=tuple(info.eos_token_ids))


def outputs_from_proto(batch: engine_core_pb2.EngineCoreOutputs) -> list[EngineOutput]:
    """One engine step's outputs; ids only listed as finished end as ABORT (unknown ids are ignored later)."""
    outputs = [
        EngineOutput(
            request_id=o.request_id, new_token_ids=list(o.new_token_ids),
            new_logprobs=[logprobs_from_proto(e) for e in o.new_logprobs],
            new_prompt_logprobs=[logprobs_from_proto(e) for e in o.new_prompt_logprobs],
            finish_reason=FinishReason(o.finish_reason) if o.finish_reason else None,
            stop_token_id=o.stop_token_id if o.HasField("stop_token_id") else None,
            num_cached_tokens=o.num_cached_tokens,
            events=[EngineEvent(EngineEventType(e.type), e.timestamp) for e in o.events],
            timestamp=batch.timestamp,
        )
        for o in batch.outputs
    ]
    seen = {o.request_id for o in outputs if o.finish_reason is not None}
    outputs.extend(EngineOutput(request_id, [], finish_reason=FinishReason.ABORT)
                   for request_id in batch.finished_request_ids if request_id not in seen)
    return outputs


def logprobs_from_proto(entry: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(list(entry.token_ids), list(entry.logprobs), entry.rank)


def utility_to_proto(call_id: int, method: str, pause_mode: str = "",
                     profile_dir: str = "") -> engine_core_pb2.EngineCoreInput:
    """method: pause, resume, sleep, wake_up, reset_prefix_cache, start_profile, stop_profile, get_stats."""
    call = engine_core_pb2.UtilityCall(
        call_id=call_id, method=engine_core_pb2.UtilityMethod.Value(f"UTILITY_METHOD_{method.upper()}"),
        pause_mode=common_pb2.PauseMode.Value(f"PAUSE_MODE_{pause_mode.upper()}") if pause_mode else 0,
        profile_dir=profile_dir,
    )
    return engine_core_pb2.EngineCoreInput(utility=call)
