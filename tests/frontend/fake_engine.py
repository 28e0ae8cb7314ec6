"""A fake tandem.v1.EngineCoreService servicer: deterministic tokens, as fast as it can, honouring aborts.

Used by the frontend tests and by the frontend-capacity benchmark (no torch, no model):

    python -m tests.frontend.fake_engine --port 50061 --vocab-size 49152

Each request generates `script(request)` (default: its prompt, repeated) up to
max_tokens, `tokens_per_step(request_id)` tokens per step. Stop token ids and
EOS end a request with STOP; max_tokens with LENGTH.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from tandem.v1 import common_pb2, engine_core_pb2, engine_core_pb2_grpc

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


def echo_prompt(request: engine_core_pb2.EngineCoreRequest) -> list[int]:
    """The default script: the prompt's tokens, repeated to max_tokens."""
    count = request.sampling_params.max_tokens if request.sampling_params.HasField("max_tokens") else 16
    return list(itertools.islice(itertools.cycle(request.prompt_token_ids), count))


def client_id(engine_request_id: str) -> str:
    """The frontend's request id behind an engine request id: AsyncLLM sends "ID@N" (N: its admission), and
    "I_ID@N" for child I of an n > 1 request ("I_ID" then); an id sent by an engine client directly is its own."""
    head, at, admission = engine_request_id.rpartition("@")
    return head if at and admission.isdigit() else engine_request_id


class _Running:
    def __init__(self, request: engine_core_pb2.EngineCoreRequest, tokens: list[int]) -> None:
        self.request, self.tokens, self.num_generated = request, tokens, 0


class FakeEngine(engine_core_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, *, vocab_size: int = 49152, max_model_len: int = 2048, model_path: str = "",
                 eos_token_id: int = 0, script: Callable[[engine_core_pb2.EngineCoreRequest], list[int]] = echo_prompt,
                 tokens_per_step: int | Callable[[str], int] = 1, step_delay_s: float = 0.0,
                 num_cached_tokens: int = 0) -> None:
        self.vocab_size, self.max_model_len, self.model_path = vocab_size, max_model_len, model_path
        self.eos_token_id = eos_token_id
        self.script = script
        self.tokens_per_step = tokens_per_step if callable(tokens_per_step) else (lambda _id: tokens_per_step)
        self.step_delay_s = step_delay_s
        self.num_cached_tokens = num_cached_tokens
        # what the tests look at
        self.added: dict[str, engine_core_pb2.EngineCoreRequest] = {}
        self.aborted: list[str] = []
        self.utility_calls: list[engine_core_pb2.UtilityCall] = []
        self.num_connections = 0
        self._streams: list[tuple[list[engine_core_pb2.EngineState], asyncio.Event]] = []  # open streams' notices

    def announce(self, **state) -> None:
        """Tell every open stream a new engine state (paused=, pause_mode=, asleep=), as a real engine does
        after pause, sleep and the like; the fake itself keeps serving whatever it says."""
        for notices, wake in self._streams:
            notices.append(engine_core_pb2.EngineState(**state))
            wake.set()

    async def GetEngineInfo(self, request, context):
        return engine_core_pb2.GetEngineInfoResponse(
            model_name="fake", model_path=self.model_path, max_model_len=self.max_model_len, block_size=16,
            num_blocks=1024, vocab_size=self.vocab_size, eos_token_ids=[self.eos_token_id], dtype="none",
            device="none", attention_backend="none", max_num_seqs=256, max_num_batched_tokens=8192,
        )

    async def Connect(self, request_iterator, context):
        self.num_connections += 1
        running: dict[str, _Running] = {}
        results: list[engine_core_pb2.UtilityResult] = []
        notices: list[engine_core_pb2.EngineState] = []
        wake = asyncio.Event()
        self._streams.append((notices, wake))

        async def read() -> None:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "add":
                    self.added[client_id(message.add.request_id)] = message.add
                    running[message.add.request_id] = _Running(message.add, self.script(message.add))
                elif kind == "abort":
                    for request_id in message.abort.request_ids:
                        self.aborted.append(client_id(request_id))
                        running.pop(request_id, None)
                elif kind == "utility":
                    self.utility_calls.append(message.utility)
                    results.append(engine_core_pb2.UtilityResult(call_id=message.utility.call_id, ok=True))
                wake.set()

        reader = asyncio.create_task(read())
        try:
            while not reader.done() or running:
                if not running and not results and not notices:
                    wake.clear()
                    waiter = asyncio.ensure_future(wake.wait())
                    try:
                        await asyncio.wait([reader, waiter], return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                batch = self._step(running)
                if results:
                    batch.utility_result.CopyFrom(results.pop(0))
                if notices:
                    batch.engine_state.CopyFrom(notices.pop(0))
                yield batch
                await asyncio.sleep(self.step_delay_s)
        finally:
            reader.cancel()
            self._streams.remove((notices, wake))
            self.aborted.extend(map(client_id, running))  # closing the stream aborts what was left

    def _step(self, running: dict[str, _Running]) -> engine_core_pb2.EngineCoreOutputs:
        batch = engine_core_pb2.EngineCoreOutputs(timestamp=time.time())
        for request_id, r in list(running.items()):
            out = batch.outputs.add(request_id=request_id, num_cached_tokens=self.num_cached_tokens)
            params = r.request.sampling_params
            if r.num_generated == 0 and params.HasField("prompt_logprobs"):
                out.new_prompt_logprobs.extend(self._logprobs(t, params.prompt_logprobs)
                                               for t in r.request.prompt_token_ids[1:])
            for _ in range(max(1, self.tokens_per_step(client_id(request_id)))):
                if r.num_generated >= len(r.tokens):
                    out.finish_reason = STOP
                    break
                token = r.tokens[r.num_generated]
                r.num_generated += 1
                out.new_token_ids.append(token)
                if params.HasField("logprobs"):
                    out.new_logprobs.append(self._logprobs(token, params.logprobs))
                if token in params.stop_token_ids or (token == self.eos_token_id and not params.ignore_eos):
                    out.finish_reason, out.stop_token_id = STOP, token
                elif params.HasField("max_tokens") and r.num_generated >= params.max_tokens:
                    out.finish_reason = LENGTH
                elif r.num_generated >= len(r.tokens):
                    out.finish_reason = STOP
                if out.finish_reason:
                    break
            if out.finish_reason:
                del running[request_id]
                batch.finished_request_ids.append(request_id)
        return batch

    def _logprobs(self, token: int, top_n: int) -> common_pb2.TokenLogprobs:
        """The chosen token at rank 1, then top_n made-up neighbours."""
        ids = [token] + [(token + k) % self.vocab_size for k in range(1, top_n + 1)]
        return common_pb2.TokenLogprobs(token_ids=ids, logprobs=[-0.5 * (k + 1) for k in range(len(ids))], rank=1)


async def start_fake_engine(address: str = "127.0.0.1:0", engine: FakeEngine | None = None,
                            **kwargs) -> tuple[grpc.aio.Server, int, FakeEngine]:
    """Start a fake engine server; returns (server, port, servicer). Stop it with `await server.stop(0)`."""
    engine = engine or FakeEngine(**kwargs)
    server = grpc.aio.server()
    engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(engine, server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port, engine


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake engine core for frontend tests and benchmarks")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50061, help="port to listen on (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=49152, help="vocabulary size to report")
    parser.add_argument("--max-model-len", type=int, default=2048, help="context length to report")
    parser.add_argument("--model-path", default="", help="model path to report (the frontend loads its tokenizer)")
    parser.add_argument("--tokens-per-step", type=int, default=1, help="tokens per request per step")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="pause after each step, like a real engine's step time (default: none, as fast as it can)")
    parser.add_argument("--script-ids", metavar="FILE",
                        help="a JSON list of token ids every request emits, cycled to max_tokens (default: the prompt)")
    args = parser.parse_args()
    script = echo_prompt
    if args.script_ids:
        ids = json.loads(Path(args.script_ids).read_text())
        script = lambda request: list(itertools.islice(itertools.cycle(ids), request.sampling_params.max_tokens))  # noqa: E731

    async def run() -> None:
        server, port, _ = await start_fake_engine(
            f"{args.host}:{args.port}", vocab_size=args.vocab_size, max_model_len=args.max_model_len,
            model_path=args.model_path, tokens_per_step=args.tokens_per_step,
            step_delay_s=args.step_ms / 1000, script=script)
        print(f"fake engine listening on {args.host}:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


if __name__ == "__main__":
    main()
