"""What a benchmark request is sent to. Each backend streams one prompt's completion and yields
(new output tokens, prompt tokens or None) per message, raising on failure.

TandemBackend      a Tandem frontend over gRPC (AsyncTandemClient)
InProcessBackend   the same frontend core over an in-process engine (no gRPC; imports torch lazily)
LlamaServerBackend a llama.cpp server's OpenAI-compatible /v1/completions endpoint (streamed SSE)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

from clients import generation
from clients.async_client import AsyncTandemClient
from clients.bench.prompts import BenchPrompt

Progress = tuple[int, int | None]  # (new output tokens, prompt tokens if known)


class TandemBackend:
    """Greedy generation of exactly max_tokens (EOS ignored) through a Tandem frontend."""

    name = "tandem-grpc"

    def __init__(self, client: AsyncTandemClient, ignore_eos: bool = True) -> None:
        self.client = client
        self.ignore_eos = ignore_eos

    async def stream(self, prompt: BenchPrompt) -> AsyncIterator[Progress]:
        target = list(prompt.token_ids) if prompt.token_ids is not None else prompt.text
        async for chunk in self.client.generate(target, max_tokens=prompt.max_tokens, temperature=0.0,
                                                ignore_eos=self.ignore_eos, output_kind="delta"):
            yield len(chunk.token_ids), chunk.num_prompt_tokens or None

    async def close(self) -> None:
        await self.client.close()


class InProcessBackend:
    """Tandem's frontend core (AsyncLLM) over InProcessEngineClient: the tandem-grpc path without its gRPC
    hops. Each request is built and converted as the servicer does, so only the transport differs.
    Imports the frontend and, through it, torch lazily; the engine steps on a thread of this process."""

    name = "in-process"

    def __init__(self, model_path: str, tokenizer_path: str, *, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, engine: tuple | None = None) -> None:
        """Starts an engine on a thread of its own, unless `engine` = (busy loop, EngineInfo) is given: then
        the caller steps it (scripts/bench_engine.py runs it on the main thread: run_beside_engine)."""
        from services.frontend.engines.in_process import start_engine
        from services.frontend.tokenizer import load_tokenizer

        self._tokenizer = load_tokenizer(tokenizer_path)
        self._busy_loop, self._info = engine or start_engine(model_path, dtype=dtype, max_model_len=max_model_len,
                                                             max_num_seqs=max_num_seqs)
        self._llm = None  # AsyncLLM, made on the event loop by the first request
        self._ids = itertools.count()

    async def stream(self, prompt: BenchPrompt) -> AsyncIterator[Progress]:
        from services.frontend import convert

        if prompt.token_ids is None:
            raise ValueError("the in-process backend needs token-id prompts")
        llm = await self._started()
        request = generation.generate_request(list(prompt.token_ids), request_id=f"bench-{next(self._ids)}",
                                              max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True,
                                              output_kind="delta")
        async for output in llm.generate(convert.prompt_from_generate(request),
                                         convert.sampling_params_from_proto(request.sampling_params),
                                         request.request_id):
            yield sum(len(c.token_ids) for c in output.completions), output.num_prompt_tokens or None

    async def _started(self):
        if self._llm is None:
            from services.frontend.async_llm import AsyncLLM
            from services.frontend.engines.in_process import InProcessEngineClient

            client = InProcessEngineClient(self._busy_loop, self._info)
            await client.start()
            self._llm = AsyncLLM(client, self._tokenizer)
        return self._llm

    async def close(self) -> None:
        if self._llm is not None:
            await self._llm.shutdown()
            await self._llm.engine_client.close()
        await asyncio.to_thread(self._busy_loop.stop)


class LlamaServerBackend:
    """A llama.cpp server (llama-server) over its OpenAI-compatible streaming completions endpoint."""

    name = "llama.cpp-server"

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.timeout_s = timeout_s

    async def stream(self, prompt: BenchPrompt) -> AsyncIterator[Progress]:
        body = {"prompt": prompt.text if prompt.text is not None else list(prompt.token_ids),
                "max_tokens": prompt.max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        reader = asyncio.ensure_future(asyncio.to_thread(self._read_events, body, loop, events))
        try:
            while True:
                event = await events.get()
                if event is None:
                    break
                if isinstance(event, BaseException):
                    raise event
                yield event, prompt.num_tokens
        finally:
            await reader

    def _read_events(self, body: dict, loop, events: asyncio.Queue) -> None:
        """POST, then one event per SSE message that carries text (llama-server streams a token each)."""
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[5:]).get("choices") or [{}]
                    if choices[0].get("text"):
                        loop.call_soon_threadsafe(events.put_nowait, 1)
            loop.call_soon_threadsafe(events.put_nowait, None)
        except (urllib.error.URLError, OSError, ValueError) as e:
            loop.call_soon_threadsafe(events.put_nowait, ConnectionError(f"llama server {self.url}: {e}"))

    async def close(self) -> None:
        pass
