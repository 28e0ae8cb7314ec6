"""vLLM's gRPC worker protocol (`vllm.grpc.engine.VllmEngine`), served beside tandem.v1 on the frontend's server.

A gateway that speaks it (the Shepherd Model Gateway, smg) renders chat templates, tokenizes and detokenizes
itself, and sends token ids; this servicer runs them through the same AsyncLLM as tandem.v1 (limits, routing
over engines, stop strings, structured output, metrics and traces) and answers with token ids. The gateway
matches stop strings in its own text but neither aborts nor cancels on a match, so the worker applies them
(the frontend's output processor does, aborting the engine request). The messages come from the pinned
`smg-grpc-proto` package; convert.py maps them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from engine_core.protocol import PoolingParams, PoolingType
from services.frontend.async_llm import AsyncLLM
from services.frontend.errors import FrontendError
from services.frontend.gateway import convert
from services.frontend.gateway.kv_event_feed import KVEventFeed, SubscriberGone
from services.frontend.gateway.tokenizer_archive import TokenizerArchive, build_tokenizer_archive

log = logging.getLogger(__name__)

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
_TRACE_KEYS = ("traceparent", "tracestate")
LOAD_HEARTBEAT_S = 1.0  # a load-only record this often while no KV event flows (smg then stops polling GetLoads)
# Where GetModelInfo points a gateway for the tokenizer: no path on its host, so smg asks GetTokenizer for
# the tokenizer and template this frontend renders with (not a copy on disk that may differ).
TOKENIZER_PATH = "tandem://get-tokenizer"


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, llm: AsyncLLM, *, version: str, status_for) -> None:
        self.llm = llm
        self.version = version
        self._status_for = status_for  # server.status_for: FrontendError -> grpc.StatusCode
        self.feed = KVEventFeed()
        llm.engine_client.add_report_listener(self.feed.on_engine_report)
        llm.prompt_listeners.append(self.feed.learn_tokens)  # every request's prompt, this API's or tandem.v1's
        self._started = time.time()
        self._last_receive = 0.0
        self._archive: tuple[object, TokenizerArchive] | None = None  # (engine info it was built for, archive)

    # ---- generation -------------------------------------------------------------------
    async def Generate(self, request, context):
        self._last_receive = time.time()
        try:
            info = self.llm.model_info
            prompt = convert.prompt_from_generate(request, info.max_model_len if info else 0)
            params = convert.sampling_params_from_proto(request.sampling_params, stream=request.stream)
        except FrontendError as e:
            await self._abort(context, e)
        prompt_ids = getattr(prompt, "token_ids", None)
        responses = convert.GenerateResponses(stream=request.stream, num_logprobs=params.logprobs,
                                              num_prompt_logprobs=params.prompt_logprobs, prompt_token_ids=prompt_ids)
        try:
            async with aclosing(self.llm.generate(prompt, params, request.request_id,
                                                  trace_headers=self._trace_headers(context))) as outputs:
                async for output in outputs:
                    for response in responses.of(output):
                        yield response
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            await self._abort(context, e)
        if prompt_ids:  # blocks the engines may have cached from the answers too
            for ids in responses.output_ids.values():
                self.feed.learn_tokens(prompt_ids + ids)

    async def Abort(self, request, context):
        self.llm.abort(list(request.request_ids))
        return convert.abort_response()

    async def Embed(self, request, context):
        self._last_receive = time.time()
        try:
            result = await self.llm.embed([convert.embed_prompt(request)], PoolingParams(PoolingType.LAST),
                                           request.request_id, trace_headers=self._trace_headers(context))
        except Exception as e:  # noqa: BLE001
            await self._abort(context, e)
        return convert.embed_response(result)

    # ---- state ------------------------------------------------------------------------
    async def HealthCheck(self, request, context):
        return convert.health_response(self.llm.not_serving_reason)

    async def GetModelInfo(self, request, context):
        info = self.llm.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine has connected yet, so the model is unknown")
        return convert.model_info_response(info, self.llm.tokenizer, tokenizer_path=TOKENIZER_PATH)

    async def GetServerInfo(self, request, context):
        client = self.llm.engine_client
        info = self.llm.model_info
        return convert.server_info_response(
            active_requests=self.llm.num_in_flight, paused=client.is_connected and not client.admitting,
            last_receive_timestamp=self._last_receive, uptime_s=time.time() - self._started,
            block_size=info.block_size if info else 0)

    async def GetLoads(self, request, context):
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank {request.dp_rank}: this worker has one rank, 0")
        return convert.loads_response(self.feed.load(), self.feed.block_size, self.version)

    async def GetTokenizer(self, request, context):
        info = self.llm.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine has connected yet, so the model is unknown")
        if self._archive is None or self._archive[0] != info:  # built once per model (a few hundred ms)
            self._archive = info, await asyncio.to_thread(build_tokenizer_archive, self.llm.tokenizer, info,
                                                          self.llm.chat_template)
        archive = self._archive[1]
        chunks = archive.chunks()
        for i, data in enumerate(chunks):
            yield convert.tokenizer_chunk(data, archive.sha256 if i == len(chunks) - 1 else "")

    async def SubscribeKvEvents(self, request, context):
        """The worker's prefix cache now (cleared, then every block), then its changes as they come, each batch
        with the load; a load-only record every LOAD_HEARTBEAT_S while nothing changes."""
        queue = self.feed.subscribe()
        sequence, event_id, sample = 0, 1, 0
        try:
            while True:
                sample += 1
                try:
                    batch = await asyncio.wait_for(queue.get(), LOAD_HEARTBEAT_S)
                except asyncio.TimeoutError:
                    load = convert.engine_load(self.feed.load(), self.feed.block_size, sample, load_only=True)
                    yield convert.load_only_batch(sequence, time.time(), load)
                    continue
                if isinstance(batch, SubscriberGone):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this KV event subscriber fell "
                                        "too far behind and was dropped; subscribe again for a fresh snapshot")
                sequence += 1
                load = convert.engine_load(self.feed.load(), self.feed.block_size, sample, load_only=False)
                proto = convert.kv_event_batch(batch, sequence, event_id, time.time(), load)
                event_id += len(proto.events)
                yield proto
        finally:
            self.feed.unsubscribe(queue)

    # ---- operator calls ---------------------------------------------------------------
    async def FlushCache(self, request, context):
        """Reset the engines' prefix caches once this frontend has nothing in flight (waiting up to timeout_s)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(request.timeout_s, 0.0)
        while self.llm.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.llm.num_in_flight:
            return convert.flush_cache_response(False, f"{self.llm.num_in_flight} requests are in flight; retry "
                                                       "with a timeout_s long enough for them to finish")
        return await self._utility(context, self.llm.reset_prefix_cache(), convert.flush_cache_response)

    async def StartProfile(self, request, context):
        if request.HasField("start_step") or request.HasField("num_steps") or request.activities:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "start_step, num_steps and activities are not "
                                "supported: Tandem profiles from StartProfile to StopProfile; set output_dir only")
        return await self._utility(context, self.llm.start_profile(request.output_dir), convert.profile_response)

    async def StopProfile(self, request, context):
        return await self._utility(context, self.llm.stop_profile(), convert.profile_response)

    async def _utility(self, context, call, respond):
        try:
            results = await call
        except Exception as e:  # noqa: BLE001
            await self._abort(context, e)
        failed = [f"engine at {r.address}: {r.error}" for r in results if not r.ok]
        return respond(not failed, "; ".join(failed) or f"done on {len(results)} engine(s)")

    # ---- helpers ----------------------------------------------------------------------
    def _trace_headers(self, context) -> dict[str, str] | None:
        """Tracing on: the OpenTelemetry interceptor already made the caller's context current."""
        if self.llm.telemetry.tracing:
            return None
        return {k: v for k, v in (context.invocation_metadata() or ()) if k in _TRACE_KEYS}

    async def _abort(self, context, error: Exception):
        if isinstance(error, convert.Unimplemented):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(error))
        if isinstance(error, FrontendError):
            code = self._status_for(error)
            self.llm.telemetry.count_error(code)
            await context.abort(code, str(error))
        log.exception("bug while serving a vLLM-protocol request", exc_info=error)
        self.llm.telemetry.count_error(grpc.StatusCode.INTERNAL)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {error!r}")
