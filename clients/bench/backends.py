"""What a benchmark request is sent to. Each backend streams one prompt's completion and yields
(new output tokens, prompt tokens or None) per message, raising on failure.

TandemBackend      a Tandem frontend over gRPC (AsyncTandemClient)
InProcessBackend   engine_core.llm_engine.LLMEngine stepped in a thread of this process (imports torch)
LlamaServerBackend a llama.cpp server's OpenAI-compatible /v1/completions endpoint (streamed SSE)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

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
    """An LLMEngine owned by one driver thread: requests go in through a queue, per-step token
    counts come back to each request's asyncio queue. Prompts must carry token ids."""

    name = "in-process"

    def __init__(self, engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._drive, name="bench-llm-engine", daemon=True)
        self._thread.start()

    async def stream(self, prompt: BenchPrompt) -> AsyncIterator[Progress]:
        from engine_core.sampling_params import SamplingParams

        if prompt.token_ids is None:
            raise ValueError("the in-process engine needs token-id prompts")
        loop, outbox = asyncio.get_running_loop(), asyncio.Queue()
        request_id = f"bench-{next(self._ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=prompt.max_tokens, ignore_eos=True)
        self._inbox.put(("add", request_id, list(prompt.token_ids), params, loop, outbox))
        finished = False
        try:
            while not finished:
                item = await outbox.get()
                if isinstance(item, BaseException):
                    raise item
                count, finished = item
                yield count, len(prompt.token_ids)
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    def _drive(self) -> None:
        streams: dict[str, tuple] = {}
        while True:
            try:
                message = self._inbox.get(block=not self.engine.has_unfinished_requests())
            except queue.Empty:
                message = None
            while message is not None:
                if message[0] == "stop":
                    return
                self._apply(message, streams)
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    message = None
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - every waiting request gets the error
                    for loop, outbox in streams.values():
                        loop.call_soon_threadsafe(outbox.put_nowait, e)
                    return
                for output in outputs:
                    loop, outbox = streams[output.request_id]
                    count = sum(len(c.new_token_ids) for c in output.outputs)
                    loop.call_soon_threadsafe(outbox.put_nowait, (count, output.finished))
                    if output.finished:
                        del streams[output.request_id]

    def _apply(self, message: tuple, streams: dict) -> None:
        if message[0] == "abort":
            self.engine.abort_request(message[1])
            streams.pop(message[1], None)
            return
        _, request_id, token_ids, params, loop, outbox = message
        try:
            self.engine.add_request(request_id, token_ids, params)
            streams[request_id] = (loop, outbox)
        except ValueError as e:  # e.g. too long for max_model_len
            loop.call_soon_threadsafe(outbox.put_nowait, e)

    async def close(self) -> None:
        self._inbox.put(("stop",))
        await asyncio.to_thread(self._thread.join, 30)


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
