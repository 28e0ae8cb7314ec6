"""AsyncTandemClient: the asyncio twin of TandemClient (same calls, same keywords, awaitable; the operator
calls too).

    async with AsyncTandemClient("localhost:50051") as client:
        async for chunk in client.generate("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2_grpc
from tandem.v1 import admin_pb2_grpc, generation_pb2_grpc

from clients import admin, embeddings, generation
from clients.admin import AdminResult
from clients.client import Metadata
from clients.connection import (
    DEFAULT_ADDRESS,
    RetryPolicy,
    TlsConfig,
    bearer_metadata,
    call_metadata,
    open_aio_channel,
)
from clients.errors import TandemError
from clients.generation import GenerateChunk, Tokens


class AsyncTandemClient:
    """A grpc.aio channel to one frontend; create it inside the event loop that uses it."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, tls: TlsConfig | None = None,
                 retry: RetryPolicy = RetryPolicy(), timeout: float | None = None, metadata: Metadata = None,
                 token: str | None = None, admin_token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = tuple(call_metadata((), metadata, None) or ())
        self._admin_metadata = self._metadata + bearer_metadata(admin_token or token)  # --admin-token-file
        self._metadata += bearer_metadata(token)  # the servers' --api-token-file / TANDEM_API_TOKEN
        self._channel = open_aio_channel(address, tls, retry)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # ---- streaming generation ----
    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, metadata: Metadata = None,
                 traceparent: str | None = None, **sampling) -> AsyncIterator[GenerateChunk]:
        """Stream a completion (see TandemClient.generate); use with `async for`."""
        request = generation.generate_request(prompt, **sampling)
        return self._stream(self._stub.Generate, request, timeout, metadata, traceparent)

    def chat(self, messages: Iterable, *, timeout: float | None = None, metadata: Metadata = None,
             traceparent: str | None = None, **sampling) -> AsyncIterator[GenerateChunk]:
        """Stream the assistant's answer (see TandemClient.chat); use with `async for`."""
        request = generation.chat_request(messages, **sampling)
        return self._stream(self._stub.Chat, request, timeout, metadata, traceparent)

    async def _stream(self, method, request, timeout, metadata, traceparent) -> AsyncIterator[GenerateChunk]:
        call = method(request, **self._call_options(timeout, metadata, traceparent))
        try:
            async for response in call:
                yield generation.chunk_from_proto(response)
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None
        finally:
            call.cancel()

    # ---- unary calls ----
    async def embed(self, inputs: str | Sequence[int] | Iterable[str | Sequence[int]], *, pooling: str = "last",
                    normalize: bool | None = None, timeout: float | None = None, metadata: Metadata = None,
                    traceparent: str | None = None, **options) -> embeddings.Embeddings:
        request = embeddings.embed_request(inputs, pooling=pooling, normalize=normalize, **options)
        answer = await self._unary(self._stub.Embed, request, timeout, metadata, traceparent)
        return embeddings.embeddings_from_proto(answer)

    async def tokenize(self, text: str | None = None, *, messages: Iterable | None = None,
                       add_special_tokens: bool | None = None, timeout: float | None = None,
                       metadata: Metadata = None, traceparent: str | None = None, **chat_options) -> Tokens:
        request = generation.tokenize_request(text, messages=messages, add_special_tokens=add_special_tokens,
                                              **chat_options)
        reply = await self._unary(self._stub.Tokenize, request, timeout, metadata, traceparent)
        return generation.tokens_from_proto(reply)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                         timeout: float | None = None, metadata: Metadata = None,
                         traceparent: str | None = None) -> str:
        request = generation.detokenize_request(token_ids, skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, request, timeout, metadata, traceparent)).text

    async def abort(self, request_ids: Sequence[str], *, timeout: float | None = None,
                    metadata: Metadata = None) -> list[str]:
        request = generation.abort_request(request_ids)
        return list((await self._unary(self._stub.Abort, request, timeout, metadata, None)).aborted_request_ids)

    async def model_info(self, *, timeout: float | None = None,
                         metadata: Metadata = None) -> generation.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, generation.model_info_request(), timeout, metadata,
                                 None)

    async def server_info(self, *, timeout: float | None = None,
                          metadata: Metadata = None) -> generation.ServerInfo:
        return await self._unary(self._stub.GetServerInfo, generation.server_info_request(), timeout, metadata,
                                 None)

    async def health(self, service: str = "", *, timeout: float | None = None, metadata: Metadata = None) -> str:
        reply = await self._unary(self._health.Check, generation.health_request(service), timeout,
                                  metadata, None)
        return generation.health_status(reply)

    # ---- operator calls (see TandemClient: same names, same keywords) ----
    async def pause(self, mode: str = "abort", *, timeout: float | None = None,
                    metadata: Metadata = None) -> AdminResult:
        """mode: abort, wait or keep (see TandemClient.pause); new requests wait for resume()."""
        return await self._operator_call("Pause", timeout, metadata, mode=mode)

    async def resume(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("Resume", timeout, metadata)

    async def sleep(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("Sleep", timeout, metadata)

    async def wake_up(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("WakeUp", timeout, metadata)

    async def reset_prefix_cache(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("ResetPrefixCache", timeout, metadata)

    async def start_profile(self, output_dir: str, *, timeout: float | None = None,
                            metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("StartProfile", timeout, metadata, output_dir=output_dir)

    async def stop_profile(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("StopProfile", timeout, metadata)

    async def drain(self, timeout_s: float = 30.0, *, timeout: float | None = None,
                    metadata: Metadata = None) -> AdminResult:
        return await self._operator_call("Drain", timeout, metadata, timeout_s=timeout_s)

    # ---- LoRA adapters (see TandemClient: same names, same keywords) ----
    async def load_lora(self, name: str, path: str, *, timeout: float | None = None,
                        metadata: Metadata = None) -> list[admin.LoraAdapter]:
        return admin.lora_adapters(await self._lora_call("LoadLoraAdapter", timeout, metadata, lora_name=name,
                                                         lora_path=path))

    async def unload_lora(self, name: str, *, timeout: float | None = None, metadata: Metadata = None) -> list[str]:
        return list((await self._lora_call("UnloadLoraAdapter", timeout, metadata, lora_name=name)).engines)

    async def list_loras(self, *, timeout: float | None = None, metadata: Metadata = None) -> list[admin.LoraAdapter]:
        return admin.lora_adapters(await self._lora_call("ListLoraAdapters", timeout, metadata))

    async def pin_lora(self, name: str, *, timeout: float | None = None,
                       metadata: Metadata = None) -> list[admin.LoraAdapter]:
        return admin.lora_adapters(await self._lora_call("PinLoraAdapter", timeout, metadata, lora_name=name))

    async def _lora_call(self, method: str, timeout, metadata, **fields):
        return await self._unary(getattr(self._admin, method), admin.admin_request(method, **fields), timeout,
                                 metadata, None, self._admin_metadata)

    async def _operator_call(self, method: str, timeout, metadata, **fields) -> AdminResult:
        reply = await self._unary(getattr(self._admin, method), admin.admin_request(method, **fields), timeout,
                                  metadata, None, self._admin_metadata)
        return admin.admin_result(reply)

    async def _unary(self, method, request, timeout, metadata, traceparent, defaults: tuple | None = None):
        try:
            return await method(request, **self._call_options(timeout, metadata, traceparent, defaults))
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None

    def _call_options(self, timeout, metadata, traceparent, defaults: tuple | None = None) -> dict:
        return {"timeout": timeout if timeout is not None else self.timeout,
                "metadata": call_metadata(self._metadata if defaults is None else defaults, metadata, traceparent)}

    # ---- lifetime ----
    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncTandemClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
