"""A scripted tandem.v1.GenerationService server on 127.0.0.1:0 for client-side behaviour (retries, TLS, metadata).

It counts the attempts of each call and records the metadata it saw; `fail_before` makes the
first N attempts end with UNAVAILABLE before any response, `fail_after_first` makes every
stream send one response and then end with UNAVAILABLE.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class ScriptedGeneration(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, fail_before: int = 0, fail_after_first: bool = False) -> None:
        self.fail_before = fail_before
        self.fail_after_first = fail_after_first
        self.attempts = 0
        self.metadata: list[dict[str, str]] = []

    def Generate(self, request, context):
        self.attempts += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.attempts <= self.fail_before:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no engine connected (scripted)")
        words = request.text.split()
        for i, word in enumerate(words):
            last = i == len(words) - 1
            yield generation_pb2.GenerateResponse(
                request_id="scripted", completions=[generation_pb2.CompletionChunk(
                    text=word + " ", token_ids=[i],
                    finish_reason=common_pb2.FINISH_REASON_STOP if last else 0)],
                usage=generation_pb2.Usage(prompt_tokens=len(words), completion_tokens=i + 1) if last else None)
            if self.fail_after_first:
                context.abort(grpc.StatusCode.UNAVAILABLE, "engine lost mid-stream (scripted)")

    def Tokenize(self, request, context):
        self.attempts += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.attempts <= self.fail_before:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no engine connected (scripted)")
        words = request.text.split()
        return generation_pb2.TokenizeResponse(token_ids=range(len(words)), tokens=words, max_model_len=99)


class ScriptedServer:
    """Start with `credentials` (grpc.ServerCredentials) for TLS, None for plaintext; always stop()."""

    def __init__(self, servicer: ScriptedGeneration, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0).wait()
