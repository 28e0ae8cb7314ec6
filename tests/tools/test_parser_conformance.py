"""Every tool parser: streamed in any chunking (one character up to whole steps), the concatenated deltas
equal the parse of the whole text; scripted calls come back as written, arguments always a JSON object."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.frontend.tools.parsers import (
    PARSERS,
    NamedFunctionParser,
    RequiredCallsParser,
    ToolCallStreamer,
    parser_for_template,
)
from tests.tools import scripted_output as script

NAMES = frozenset(script.TOOL_NAMES)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(parser, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed `text` cut at `cuts`, then finish; rebuild text and calls from the deltas alone."""
    streamer = ToolCallStreamer(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    out_text, calls = "", []
    for delta in deltas:
        out_text += delta.text
        for d in delta.tool_calls:
            if d.index == len(calls):
                assert d.id and d.name, "a call's first delta carries its id and name"
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                assert d.index < len(calls) and d.id is None and d.name is None
                calls[d.index]["arguments"] += d.arguments
    final = [{"id": c.id, "name": c.name, "arguments": c.arguments_json} for c in streamer.tool_calls]
    assert out_text == streamer.text and calls == final, "deltas add up to the streamer's own result"
    return out_text, [(c["name"], c["arguments"]) for c in calls]


def whole(parser_factory, text: str) -> tuple[str, list[tuple[str, str]]]:
    return stream(parser_factory(), text, [])


def parsers():
    return {**{name: (lambda cls=cls: cls(NAMES)) for name, cls in PARSERS.items()},
            "required": lambda: RequiredCallsParser(NAMES), "named": lambda: NamedFunctionParser("search")}


def chunkings(text_strategy):
    """A text and cut points: single characters, random step sizes, or both mixed."""
    @st.composite
    def build(draw):
        text = draw(text_strategy)
        if not text:
            return text, []
        style = draw(st.sampled_from(["chars", "random", "steps"]))
        if style == "chars":
            return text, list(range(1, len(text)))
        if style == "steps":
            step = draw(st.integers(2, 12))
            return text, list(range(step, len(text), step))
        return text, sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    return build()


# ---- any text at all: streaming never disagrees with the whole parse -----------------------------------
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]",
             '"name"', '"arguments"', '"parameters"', ":", ",", ";", '"get_weather"', '"search"', '"x"', " ", "\n",
             "1", "a", "\\", '"', '"launch_rockets"', "search(", "get_weather(", "x=", ")", "'", "=", "null"]
fuzz_text = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)


@pytest.mark.parametrize("parser", sorted(parsers()))
@SETTINGS
@given(case=chunkings(fuzz_text))
def test_any_chunking_equals_the_whole_parse(parser, case):
    text, cuts = case
    factory = parsers()[parser]
    assert stream(factory(), text, cuts) == whole(factory, text)


# ---- scripted output: calls come back as written ----------------------------------------------------
def scripted(parser: str):
    @st.composite
    def build(draw):
        calls = draw(st.lists(script.maybe_unknown_calls, max_size=3))
        spaced = draw(st.booleans())
        if parser in ("hermes", "mistral"):
            before = draw(st.sampled_from(["", "Let me check."]) | script.plain_text)
            after = draw(st.sampled_from(["", "Done."]))
            render = getattr(script, parser)
            return render(before, calls, after, spaced) if calls else before + after, calls, before + after
        calls = [c for c in calls if c.known] or [script.Call("search", {"q": "x"})]
        return getattr(script, parser)(calls, spaced), calls, ""
    return build()


def _check_scripted(parser, case, cuts):
    text, calls, plain = case
    factory = parsers()[parser]
    got_text, got_calls = stream(factory(), text, cuts)
    assert (got_text, got_calls) == whole(factory, text)
    known = [c for c in calls if c.known]
    assert [(name, json.loads(arguments)) for name, arguments in got_calls] == [(c.name, c.arguments) for c in known]
    if all(c.known for c in calls):  # a call to an unknown tool stays in the text as the model wrote it
        assert "".join(got_text.split()) == "".join(plain.split())


@pytest.mark.parametrize("parser", sorted(PARSERS))
@SETTINGS
@given(data=st.data())
def test_scripted_calls_come_back_in_any_chunking(parser, data):
    text, calls, plain = data.draw(scripted(parser))
    _, cuts = data.draw(chunkings(st.just(text)))
    _check_scripted(parser, (text, calls, plain), cuts)


@pytest.mark.parametrize("parser", sorted(PARSERS))
@SETTINGS
@given(data=st.data())
def test_output_cut_anywhere_streams_like_its_whole_parse(parser, data):
    """max_tokens may end the text anywhere: inside a tag, a name, the arguments."""
    text, _, _ = data.draw(scripted(parser))
    cut_text = text[:data.draw(st.integers(0, len(text)))]
    _, cuts = data.draw(chunkings(st.just(cut_text)))
    factory = parsers()[parser]
    assert stream(factory(), cut_text, cuts) == whole(factory, cut_text)


# ---- the cases users report -----------------------------------------------------------------------
def test_half_a_tag_is_held_back_then_flushed_as_text_at_the_end():
    streamer = ToolCallStreamer(PARSERS["hermes"](NAMES))
    assert streamer.feed("Hello <tool_").text == "Hello "
    assert streamer.finish().text == "<tool_"


def test_an_unclosed_call_with_a_name_is_a_call_and_without_one_is_text():
    assert whole(parsers()["hermes"], '<tool_call>{"name": "search", "arguments": {"q": "ab')[1] == [
        ("search", '{"q": "ab')]
    assert whole(parsers()["hermes"], '<tool_call>{"name": "sea') == ('<tool_call>{"name": "sea', [])


def test_a_call_to_an_unknown_tool_is_text():
    text = '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
    assert whole(parsers()["hermes"], text) == (text, [])
    text = 'x[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}] y'
    expected = ('x{"name": "launch_rockets", "arguments": {}} y', [])
    assert whole(parsers()["mistral"], text) == expected
    assert stream(parsers()["mistral"](), text, list(range(1, len(text)))) == expected


def test_parallel_calls_stay_apart_and_arguments_given_as_a_string_become_an_object():
    text = ('[TOOL_CALLS][{"name": "search", "arguments": "{\\"q\\": \\"a\\"}"}, '
            '{"name": "search", "arguments": {"q": "b"}}]')
    assert whole(parsers()["mistral"], text) == ("", [("search", '{"q": "a"}'), ("search", '{"q": "b"}')])


def test_text_before_a_llama3_or_pythonic_call_makes_it_all_text():
    text = 'Sure: {"name": "search", "parameters": {}}'
    assert whole(parsers()["llama3_json"], text) == (text, [])
    assert whole(parsers()["pythonic"], "ok [search(q='a')]") == ("ok [search(q='a')]", [])


def test_arguments_arrive_in_fragments_after_the_name():
    streamer = ToolCallStreamer(PARSERS["hermes"](NAMES))
    first = streamer.feed('<tool_call>{"name": "search", "arguments": {"q": "ab')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("search", '{"q": "ab')]
    second = streamer.feed('c"}}</tool_call>')
    assert [(d.index, d.id, d.arguments) for d in second.tool_calls] == [(0, None, 'c"}')]


@pytest.mark.parametrize(("template", "parser"), [
    ("{{ '<tool_call>' }}", "hermes"), ("[TOOL_CALLS]", "mistral"), ('{"name": x, "parameters": y}', "llama3_json"),
    ("[func_name1(params_name1=params_value1)]", "pythonic"), ("{{ messages }}", None),
])
def test_the_template_picks_the_parser(template, parser):
    assert parser_for_template(template) == parser


@pytest.mark.parametrize("parser", sorted(PARSERS))
@SETTINGS
@given(data=st.data())
def test_mangled_output_streams_like_its_whole_parse(parser, data):
    """Scripted output with fragments spliced in and characters cut out: broken tags, stray quotes."""
    text, _, _ = data.draw(scripted(parser))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        if data.draw(st.booleans()):
            text = text[:at] + data.draw(st.sampled_from(FRAGMENTS)) + text[at:]
        else:
            text = text[:at] + text[at + data.draw(st.integers(1, 3)):]
    _, cuts = data.draw(chunkings(st.just(text)))
    factory = parsers()[parser]
    assert stream(factory(), text, cuts) == whole(factory, text)
