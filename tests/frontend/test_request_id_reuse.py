"""A client may reuse a request id as soon as its request ended. A stop string ends a request in the frontend
before the engine hears of the abort, so the engine may still send a step of the old request: it must not reach
the new request of the same id (AsyncLLM gives each admission's engine requests ids of their own)."""

from __future__ import annotations

import asyncio

from engine_core.protocol import EngineCoreOutput, EngineInfo, FinishReason, SamplingParams
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.client import EngineClient, OutputBatch


class HandFedEngineClient(EngineClient):
    """A connected engine whose outputs the test hands in, one step at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.added, self.aborted = [], []

    async def start(self): ...
    async def close(self): ...
    async def call_utility(self, call): return []
    async def wait_for_engine(self): return self.engine_info
    def engines(self): return []
    is_connected = admitting = True
    num_in_flight = 0
    engine_info = EngineInfo("fake", "", max_model_len=2048, vocab_size=49152)

    def add_request(self, request):
        self.added.append(request)

    def abort(self, request_ids):
        self.aborted += request_ids

    def step(self, request_id: str, token_ids: list[int], finished: bool = False) -> None:
        self._put_output(OutputBatch(outputs=[EngineCoreOutput(
            request_id, token_ids, finish_reason=FinishReason.STOP if finished else None)]))


def test_a_late_step_of_an_ended_request_never_reaches_a_new_request_of_the_same_id(tokenizer):
    engine = HandFedEngineClient()
    llm = AsyncLLM(engine, tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    params = SamplingParams(max_tokens=50, stop=[" STOP"], temperature=0.0)

    async def text_of(request_id: str, steps: list[tuple[bool, list[int], bool]]) -> str:
        """Run a request; `steps`: (to the first request's engine id instead of this one's?, tokens, finished),
        handed in once the engine has the request."""
        sent = len(engine.added)
        stream = llm.generate(encode("question"), params, request_id=request_id)
        first = asyncio.ensure_future(anext(stream))
        while len(engine.added) == sent:  # the generator runs up to add_request
            await asyncio.sleep(0)
        first_id, this_id = engine.added[0].request_id, engine.added[-1].request_id
        for to_first, tokens, finished in steps:
            engine.step(first_id if to_first else this_id, tokens, finished)
        outputs = [await first] + [output async for output in stream]
        return outputs[-1].outputs[0].text

    async def run():
        old = await text_of("reused", [(False, encode("Hello STOP and more"), False)])
        new = await text_of("reused", [(True, encode(" stale"), False), (False, encode("Fresh"), True)])
        await llm.shutdown()
        return old, new

    old, new = asyncio.run(run())
    assert old == "Hello"
    assert new == "Fresh"
    assert len({request.request_id for request in engine.added}) == 2  # the engine saw two different ids
