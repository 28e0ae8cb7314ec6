"""Stop strings across token boundaries (hypothesis): random text, split at random points into
token-ish pieces that the fake engine emits a random number at a time."""

from __future__ import annotations

import itertools
import uuid

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tandem.v1 import common_pb2, generation_pb2

from tests.frontend.conftest import wait_until

ALPHABET = "ab cé\n"  # few letters, so stop strings hit often; é spans two bytes
PADDING = ["!"] * 12  # 12 tokens after the text: no stop string matches in them, and the engine is still running


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The final text and stop string, by brute force: the first stop string to complete wins
    (the longest on a tie); the text is cut before it, or after it with include."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(ALPHABET, min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    steps=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    kind=st.sampled_from([common_pb2.OUTPUT_KIND_DELTA, common_pb2.OUTPUT_KIND_CUMULATIVE]),
)
def test_stop_strings(stack, text, cuts, stops, include, steps, kind):
    tok = stack.tokenizer
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *sorted(set(cuts)), len(text)]) if a < b]
    ids = [i for piece in [*pieces, *PADDING] for i in tok.encode(piece, add_special_tokens=False)]
    full = tok.decode(ids)
    assume(full == text + "".join(PADDING))
    request_id = uuid.uuid4().hex
    stack.scripts[request_id], stack.steps[request_id] = ids, list(steps)
    request = generation_pb2.GenerateRequest(request_id=request_id, text="stop strings", sampling_params=(
        common_pb2.SamplingParams(max_tokens=len(ids), stop=stops, include_stop_str_in_output=include,
                                  output_kind=kind)))

    async def run():
        responses = [r async for r in stack.stub.Generate(request)]
        return responses, [c for r in responses for c in r.completions]

    responses, chunks = stack.run(run())
    expected_text, expected_stop = reference(full, stops, include)
    seen = [c.text for c in chunks]
    if kind == common_pb2.OUTPUT_KIND_DELTA:
        streamed = list(itertools.accumulate(seen))
    else:
        streamed = seen
    # no message ever shows text that is later taken back (half a stop string)
    assert all(expected_text.startswith(s) for s in streamed)
    assert streamed[-1] == expected_text
    if not include:
        assert not any(stop in s for s in streamed for stop in stops)
    # token ids: the script's, up to the one that completed the stop string (a step may emit several past it)
    token_ids = [i for c in chunks for i in c.token_ids] if kind == common_pb2.OUTPUT_KIND_DELTA else \
        list(chunks[-1].token_ids)
    assert token_ids == ids[:len(token_ids)]
    if expected_stop is not None:
        assert reference(tok.decode(token_ids), stops, include)[1] is not None
        assert reference(tok.decode(token_ids[:-1]), stops, include)[1] is None
    last = chunks[-1]
    if expected_stop is None:
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    else:
        assert (last.finish_reason, last.stop_string) == (common_pb2.FINISH_REASON_STOP, expected_stop)
        stack.run(wait_until(lambda: request_id in stack.engine.aborted))  # the engine stops generating
    assert responses[-1].usage.prompt_tokens > 0


def test_stop_string_split_over_tokens_is_held_back(stack):
    """A stop string arriving one token at a time never shows up, even in part."""
    tok = stack.tokenizer
    ids = [i for piece in ["Hello", " wor", "ld", " ST", "O", "P", " more", *PADDING]
           for i in tok.encode(piece, add_special_tokens=False)]
    request_id = f"held-{uuid.uuid4().hex[:8]}"  # the stack lives for the module; make test-shake repeats this
    stack.scripts[request_id] = ids
    request = generation_pb2.GenerateRequest(request_id=request_id, text="x", sampling_params=common_pb2.SamplingParams(
        max_tokens=len(ids), stop=[" STOP"]))

    async def run():
        return [c.text for r in [r async for r in stack.stub.Generate(request)] for c in r.completions]

    deltas = stack.run(run())
    assert "".join(deltas) == "Hello world"
    assert not any("S" in d for d in deltas)
    stack.run(wait_until(lambda: request_id in stack.engine.aborted))
