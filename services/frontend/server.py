"""The frontend's gRPC servicers: thin shells that convert protos to AsyncLLM calls and back.

Errors become status codes with messages a person can act on; bad input is never INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from services.frontend import convert
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.client import EngineCallResult
from services.frontend.errors import (
    DuplicateRequest,
    EngineUnavailable,
    FailedPrecondition,
    FrontendError,
    InvalidRequest,
    NotFound,
    TooManyRequests,
)
from services.frontend.gateway.servicer import SERVICE_NAME as VLLM_ENGINE_SERVICE
from services.frontend.gateway.servicer import VllmEngineServicer
from services.frontend.health import ADMIN_SERVICE, GENERATION_SERVICE, FrontendHealth
from services.frontend.input_processor import TextPrompt
from services.security.transport import ServerTransport

log = logging.getLogger(__name__)

VERSION = "0.1.0"
_TRACE_KEYS = ("traceparent", "tracestate")
_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    TooManyRequests: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(error: FrontendError) -> grpc.StatusCode:
    return next((code for kind, code in _STATUS.items() if isinstance(error, kind)), grpc.StatusCode.INTERNAL)


async def _abort(context, error: Exception):
    """End the call with the status that fits `error` (raises)."""
    if isinstance(error, FrontendError):
        await context.abort(status_for(error), str(error))
    log.exception("bug while serving a request", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {error!r}")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    async def Generate(self, request, context):
        prompt = convert.prompt_from_generate(request)
        async for response in self._stream(context, request.request_id, prompt, request.sampling_params,
                                           request.priority, generation_pb2.GenerateResponse, request.lora_name):
            yield response

    async def Chat(self, request, context):
        prompt = convert.prompt_from_chat(request)
        async for response in self._stream(context, request.request_id, prompt, request.sampling_params,
                                           request.priority, generation_pb2.ChatResponse, request.lora_name):
            yield response

    async def Embed(self, request, context):
        trace_headers = None if self.llm.telemetry.tracing else {
            k: v for k, v in (context.invocation_metadata() or ()) if k in _TRACE_KEYS}
        try:
            prompts, pooling = convert.embed_from_proto(request)
            result = await self.llm.embed(prompts, pooling, request.request_id, priority=request.priority,
                                          trace_headers=trace_headers, lora_name=request.lora_name or None)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            self.llm.telemetry.count_error(status_for(e) if isinstance(e, FrontendError) else grpc.StatusCode.INTERNAL)
            await _abort(context, e)
        return convert.embed_response(result)

    async def _stream(self, context, request_id, prompt, sampling_proto, priority, response_type, lora_name=""):
        # Tracing on: the OpenTelemetry interceptor already made the client's context current.
        trace_headers = None if self.llm.telemetry.tracing else {
            k: v for k, v in (context.invocation_metadata() or ()) if k in _TRACE_KEYS}
        sampling_params = convert.sampling_params_from_proto(sampling_proto)
        try:
            async with aclosing(self.llm.generate(prompt, sampling_params, request_id, priority=priority,
                                                  trace_headers=trace_headers, lora_name=lora_name or None)) as outputs:
                async for output in outputs:
                    yield convert.response_from_output(output, response_type)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            self.llm.telemetry.count_error(status_for(e) if isinstance(e, FrontendError) else grpc.StatusCode.INTERNAL)
            await _abort(context, e)

    async def Tokenize(self, request, context):
        processor = self.llm.input_processor
        try:
            if request.WhichOneof("input") == "chat":
                chat = convert.prompt_from_chat(request.chat)
                ids = processor.tokenize(chat, processor.plan_tools(chat, None))
            else:
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = processor.tokenize(TextPrompt(request.text, add_special_tokens=add_special))
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
        tokenizer = self.llm.tokenizer.tokenizer
        return convert.tokenize_response(ids, [tokenizer.id_to_token(i) or "" for i in ids], processor.max_model_len)

    async def Detokenize(self, request, context):
        vocab_size = self.llm.tokenizer.vocab_size
        for i, token_id in enumerate(request.token_ids):
            if not 0 <= token_id < vocab_size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids[{i}] = {token_id} is out of "
                                    f"range: the tokenizer has ids 0..{vocab_size - 1}")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return convert.detokenize_response(self.llm.tokenizer.decode(list(request.token_ids), skip))

    async def Abort(self, request, context):
        return convert.abort_response(self.llm.abort(list(request.request_ids)))

    async def GetModelInfo(self, request, context):
        info = self.llm.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine has connected yet, so the model is unknown")
        return convert.model_info_to_proto(info, has_chat_template=bool(self.llm.tokenizer.chat_template))

    async def GetServerInfo(self, request, context):
        return convert.server_info_to_proto(VERSION, self.llm.num_in_flight, self.llm.max_waiting_requests,
                                            self.llm.engine_client.engines(), draining=self.llm.draining,
                                            serving=self.llm.serving)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Operator calls, forwarded to every connected engine as utility calls."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    async def Pause(self, request, context):
        try:
            mode = convert.pause_mode_from_proto(request.mode)
        except InvalidRequest as e:
            await _abort(context, e)
        return await self._forward(context, self.llm.pause_generation(mode), admin_pb2.PauseResponse)

    async def Resume(self, request, context):
        return await self._forward(context, self.llm.resume_generation(), admin_pb2.ResumeResponse)

    async def Sleep(self, request, context):
        return await self._forward(context, self.llm.sleep(), admin_pb2.SleepResponse)

    async def WakeUp(self, request, context):
        return await self._forward(context, self.llm.wake_up(), admin_pb2.WakeUpResponse)

    async def ResetPrefixCache(self, request, context):
        return await self._forward(context, self.llm.reset_prefix_cache(), admin_pb2.ResetPrefixCacheResponse)

    async def StartProfile(self, request, context):
        if not request.output_dir:
            await _abort(context, InvalidRequest("output_dir is empty: give the folder for the trace, on the "
                                                 "engine's machine (made if missing)"))
        return await self._forward(context, self.llm.start_profile(request.output_dir), admin_pb2.StartProfileResponse)

    async def StopProfile(self, request, context):
        return await self._forward(context, self.llm.stop_profile(), admin_pb2.StopProfileResponse)

    async def Drain(self, request, context):
        try:
            left = await self.llm.drain(request.timeout_s)
        except InvalidRequest as e:
            await _abort(context, e)
        return convert.drain_response(left, request.timeout_s)

    async def LoadLoraAdapter(self, request, context):
        results = await self._lora_call(context, self.llm.add_lora(request.lora_name, request.lora_path))
        return admin_pb2.LoadLoraAdapterResponse(adapters=convert.lora_adapters(results))

    async def UnloadLoraAdapter(self, request, context):
        results = await self._lora_call(context, self.llm.remove_lora(request.lora_name))
        return admin_pb2.UnloadLoraAdapterResponse(engines=[r.address for r in results])

    async def ListLoraAdapters(self, request, context):
        results = await self._lora_call(context, self.llm.list_loras())
        return admin_pb2.ListLoraAdaptersResponse(adapters=convert.lora_adapters(results))

    async def PinLoraAdapter(self, request, context):
        results = await self._lora_call(context, self.llm.pin_lora(request.lora_name))
        return admin_pb2.PinLoraAdapterResponse(adapters=convert.lora_adapters(results))

    async def _lora_call(self, context, call) -> list[EngineCallResult]:
        """A LoRA call's results; a refusal ends the call with its status (engines/lora_results.py)."""
        try:
            return await call
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def _forward(self, context, call, response_type):
        """Await the engines' utility results and answer with one `response_type` (ok, detail)."""
        try:
            results: list[EngineCallResult] = await call
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
        return convert.admin_response(results, response_type)


# ---- the server -------------------------------------------------------------------
class FrontendServer:
    """The grpc.aio server: GenerationService, AdminService, vLLM's worker protocol for gateways
    (gateway/servicer.py), health (services/frontend/health.py), reflection.

    `transport` sets TLS, the bearer-token interceptor and the message size limit (default: plaintext).
    """

    def __init__(self, llm: AsyncLLM, address: str, *, transport: ServerTransport = ServerTransport()) -> None:
        self.llm = llm
        self.server = transport.server(*llm.telemetry.server_interceptors())
        self.health = FrontendHealth(llm)
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(llm), self.server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(llm), self.server)
        self.vllm_engine = VllmEngineServicer(llm, version=VERSION, status_for=status_for)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_engine, self.server)
        self.health.add_to_server(self.server)
        services = (GENERATION_SERVICE, ADMIN_SERVICE, VLLM_ENGINE_SERVICE,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        try:
            self.port = transport.add_port(self.server, address)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if not self.port:
            raise OSError(f"cannot listen on {address}")

    async def start(self) -> None:
        await self.server.start()
        await self.health.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain, then stop: health NOT_SERVING, new requests UNAVAILABLE ("draining") while the server still
        listens, in-flight streams get up to `grace_s` to finish, then whatever is left is cancelled."""
        grace_s = max(grace_s, 0.0)
        deadline = asyncio.get_running_loop().time() + grace_s
        await self.health.shutdown()
        await self.llm.drain(grace_s)  # sets draining: admits nothing new
        await self.server.stop(max(deadline - asyncio.get_running_loop().time(), 0.0))
        await self.llm.shutdown()
