"""TandemClient: the blocking Python client of a Tandem frontend.

    from clients.client import TandemClient

    with TandemClient("localhost:50051") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], temperature=0, max_tokens=32):
            print(chunk.text, end="", flush=True)

Every call takes `timeout=` (seconds, the gRPC deadline), `metadata=` (extra gRPC metadata) and
`traceparent=` (a W3C trace context, passed through to the server's traces); `token=` on the
client sends `authorization: Bearer <token>` with every call (`admin_token=`, when given, with the
operator calls instead). Failures raise TandemError with the gRPC status code and the server's
message. The async twin is `clients.async_client.AsyncTandemClient`.

The operator calls (tandem.v1.AdminService: pause, resume, sleep, wake_up, reset_prefix_cache,
start_profile, stop_profile, drain) return an AdminResult: `ok` is False, with the reason in
`detail`, when an engine refused (e.g. sleep while requests are in flight).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2_grpc
from tandem.v1 import admin_pb2_grpc, generation_pb2_grpc

from clients import admin, embeddings, generation
from clients.admin import AdminResult
from clients.connection import (
    DEFAULT_ADDRESS,
    RetryPolicy,
    TlsConfig,
    bearer_metadata,
    call_metadata,
    open_channel,
)
from clients.errors import TandemError
from clients.generation import GenerateChunk, Tokens

Metadata = Mapping[str, str] | Sequence[tuple[str, str]] | None


class TandemClient:
    """A channel to one frontend. Thread-safe; close() it (or use `with`) when done."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, tls: TlsConfig | None = None,
                 retry: RetryPolicy = RetryPolicy(), timeout: float | None = None, metadata: Metadata = None,
                 token: str | None = None, admin_token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout  # the default deadline of every call
        self._metadata = tuple(call_metadata((), metadata, None) or ())
        self._admin_metadata = self._metadata + bearer_metadata(admin_token or token)  # --admin-token-file
        self._metadata += bearer_metadata(token)  # the servers' --api-token-file / TANDEM_API_TOKEN
        self._channel = open_channel(address, tls, retry)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # ---- streaming generation ----
    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, metadata: Metadata = None,
                 traceparent: str | None = None, **sampling) -> Iterator[GenerateChunk]:
        """Stream a completion of a text prompt or of token ids. Keywords: SamplingParams fields
        (temperature, max_tokens, stop, seed, ...) and request_id, priority, add_special_tokens, lora_name."""
        request = generation.generate_request(prompt, **sampling)
        return self._stream(self._stub.Generate, request, timeout, metadata, traceparent)

    def chat(self, messages: Iterable, *, timeout: float | None = None, metadata: Metadata = None,
             traceparent: str | None = None, **sampling) -> Iterator[GenerateChunk]:
        """Stream the assistant's answer to chat messages. Keywords: SamplingParams fields and
        request_id, priority, add_generation_prompt, continue_final_message, lora_name, and tools, tool_choice,
        parallel_tool_calls (calls arrive as chunk.completions[i].tool_call_deltas, then tool_calls)."""
        request = generation.chat_request(messages, **sampling)
        return self._stream(self._stub.Chat, request, timeout, metadata, traceparent)

    def _stream(self, method, request, timeout, metadata, traceparent) -> Iterator[GenerateChunk]:
        call = method(request, **self._call_options(timeout, metadata, traceparent))
        try:
            for response in call:
                yield generation.chunk_from_proto(response)
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a consumer that stops early aborts the request on the server

    # ---- unary calls ----
    def embed(self, inputs: str | Sequence[int] | Iterable[str | Sequence[int]], *, pooling: str = "last",
              normalize: bool | None = None, timeout: float | None = None, metadata: Metadata = None,
              traceparent: str | None = None, **options) -> embeddings.Embeddings:
        """One vector per input (a text, token ids, or a list of them) from the model's final hidden
        states; pooling: last | mean | cls; normalize: unit L2 norm (the server's default: true).
        Options: request_id, priority, add_special_tokens, lora_name."""
        request = embeddings.embed_request(inputs, pooling=pooling, normalize=normalize, **options)
        return embeddings.embeddings_from_proto(self._unary(self._stub.Embed, request, timeout, metadata, traceparent))

    def tokenize(self, text: str | None = None, *, messages: Iterable | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = None, metadata: Metadata = None,
                 traceparent: str | None = None, **chat_options) -> Tokens:
        """Token ids and token strings of text, or of chat messages rendered by the chat template."""
        request = generation.tokenize_request(text, messages=messages, add_special_tokens=add_special_tokens,
                                              **chat_options)
        return generation.tokens_from_proto(self._unary(self._stub.Tokenize, request, timeout, metadata, traceparent))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = None, metadata: Metadata = None, traceparent: str | None = None) -> str:
        request = generation.detokenize_request(token_ids, skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout, metadata, traceparent).text

    def abort(self, request_ids: Sequence[str], *, timeout: float | None = None,
              metadata: Metadata = None) -> list[str]:
        """Abort in-flight requests by id; returns those that were in flight."""
        request = generation.abort_request(request_ids)
        return list(self._unary(self._stub.Abort, request, timeout, metadata, None).aborted_request_ids)

    def model_info(self, *, timeout: float | None = None,
                   metadata: Metadata = None) -> generation.ModelInfo:
        return self._unary(self._stub.GetModelInfo, generation.model_info_request(), timeout, metadata, None)

    def server_info(self, *, timeout: float | None = None,
                    metadata: Metadata = None) -> generation.ServerInfo:
        return self._unary(self._stub.GetServerInfo, generation.server_info_request(), timeout, metadata, None)

    def health(self, service: str = "", *, timeout: float | None = None, metadata: Metadata = None) -> str:
        """The grpc.health.v1 status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN."""
        reply = self._unary(self._health.Check, generation.health_request(service), timeout, metadata,
                            None)
        return generation.health_status(reply)

    # ---- operator calls (tandem.v1.AdminService, forwarded to every engine) ----
    def pause(self, mode: str = "abort", *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        """Pause generation. mode: abort (abort the requests in flight, then pause), wait (admit nothing new, let
        running requests finish, then pause), keep (freeze everything in place). New requests wait for resume()."""
        return self._operator_call("Pause", timeout, metadata, mode=mode)

    def resume(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        """Continue after pause(); also ends a drain()."""
        return self._operator_call("Resume", timeout, metadata)

    def sleep(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        """Free the engines' KV cache until wake_up(); refused while requests are in flight (pause first)."""
        return self._operator_call("Sleep", timeout, metadata)

    def wake_up(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return self._operator_call("WakeUp", timeout, metadata)

    def reset_prefix_cache(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return self._operator_call("ResetPrefixCache", timeout, metadata)

    def start_profile(self, output_dir: str, *, timeout: float | None = None,
                      metadata: Metadata = None) -> AdminResult:
        """Profile the engines' steps into `output_dir`, a folder on each engine's machine."""
        return self._operator_call("StartProfile", timeout, metadata, output_dir=output_dir)

    def stop_profile(self, *, timeout: float | None = None, metadata: Metadata = None) -> AdminResult:
        return self._operator_call("StopProfile", timeout, metadata)

    def drain(self, timeout_s: float = 30.0, *, timeout: float | None = None,
              metadata: Metadata = None) -> AdminResult:
        """Stop admitting requests on this frontend (health NOT_SERVING) and wait up to timeout_s for those in
        flight; ok when none is left. resume() ends it."""
        return self._operator_call("Drain", timeout, metadata, timeout_s=timeout_s)

    # ---- LoRA adapters (docs/lora.md); refusals raise TandemError with the server's status ----
    def load_lora(self, name: str, path: str, *, timeout: float | None = None,
                  metadata: Metadata = None) -> list[admin.LoraAdapter]:
        """Load the PEFT adapter folder `path` (on the engines' machines) into every engine as `name`."""
        return admin.lora_adapters(self._lora_call("LoadLoraAdapter", timeout, metadata, lora_name=name,
                                                   lora_path=path))

    def unload_lora(self, name: str, *, timeout: float | None = None, metadata: Metadata = None) -> list[str]:
        """Unload an adapter everywhere; the engines it left. Refused (FAILED_PRECONDITION) while in use."""
        return list(self._lora_call("UnloadLoraAdapter", timeout, metadata, lora_name=name).engines)

    def list_loras(self, *, timeout: float | None = None, metadata: Metadata = None) -> list[admin.LoraAdapter]:
        return admin.lora_adapters(self._lora_call("ListLoraAdapters", timeout, metadata))

    def pin_lora(self, name: str, *, timeout: float | None = None,
                 metadata: Metadata = None) -> list[admin.LoraAdapter]:
        """Keep an adapter in every engine's host memory (never pushed out by others)."""
        return admin.lora_adapters(self._lora_call("PinLoraAdapter", timeout, metadata, lora_name=name))

    def _lora_call(self, method: str, timeout, metadata, **fields):
        return self._unary(getattr(self._admin, method), admin.admin_request(method, **fields), timeout, metadata,
                           None, self._admin_metadata)

    def _operator_call(self, method: str, timeout, metadata, **fields) -> AdminResult:
        reply = self._unary(getattr(self._admin, method), admin.admin_request(method, **fields), timeout, metadata,
                            None, self._admin_metadata)
        return admin.admin_result(reply)

    def _unary(self, method, request, timeout, metadata, traceparent, defaults: tuple | None = None):
        try:
            return method(request, **self._call_options(timeout, metadata, traceparent, defaults))
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None

    def _call_options(self, timeout, metadata, traceparent, defaults: tuple | None = None) -> dict:
        return {"timeout": timeout if timeout is not None else self.timeout,
                "metadata": call_metadata(self._metadata if defaults is None else defaults, metadata, traceparent)}

    # ---- lifetime ----
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "TandemClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
