"""Golden: for chat templates with a tools branch (Qwen2.5, Llama 3.1 JSON, Llama 3.2 pythonic, Mistral),
Tandem's rendered prompt equals transformers' apply_chat_template(..., tools=...) on a tiny tokenizer that
carries the template, for hypothesis-made conversations and tool sets. The shipped SmolLM2 tools template
renders plain chats exactly as the model's own template does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from services.frontend.chat.template_choice import TEMPLATES, choose_chat_setup
from services.frontend.input_processor import ChatPrompt, InputProcessor
from services.frontend.tokenizer import TokenizerBundle
from services.frontend.tools.request import ToolRequest, ToolSpec, plan_tools

FIXTURES = Path(__file__).parent / "templates"  # sources in templates/SOURCES.md
FAMILIES = {  # template -> (calls per assistant message, tool call ids must have 9+ characters)
    "qwen2_5.jinja": 3, "llama3_1_json.jinja": 1, "llama3_2_pythonic.jinja": 3, "mistral_parallel.jinja": 3,
}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

words = st.text(st.sampled_from(list("abc xyz,.?!é\"'{}")), min_size=1, max_size=20).filter(str.strip)
names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
json_scalar = st.none() | st.booleans() | st.integers(-1000, 1000) | words
arguments = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                            json_scalar | st.lists(json_scalar, max_size=2), max_size=3)
parameter_schema = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
    st.from_regex(r"[a-z]{1,6}", fullmatch=True),
    st.sampled_from([{"type": "string"}, {"type": "integer", "description": "a number"},
                     {"type": "string", "enum": ["a", "b"]}, {"type": "array", "items": {"type": "number"}}]),
    max_size=3)})


@st.composite
def conversations(draw, calls_per_message: int):
    """[system] user [assistant calls, tool results, assistant answer, user], and the tool set."""
    tools = draw(st.lists(st.tuples(names, words, parameter_schema), min_size=1, max_size=3,
                          unique_by=lambda t: t[0]))
    messages = [{"role": "system", "content": draw(words)}] if draw(st.booleans()) else []
    messages.append({"role": "user", "content": draw(words)})
    if draw(st.booleans()):
        tool_names = st.sampled_from([t[0] for t in tools])
        count = draw(st.integers(1, calls_per_message))
        calls = [{"id": f"call{draw(st.integers(10000, 99999))}", "name": draw(tool_names),
                  "arguments_json": json.dumps(draw(arguments))} for _ in range(count)]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        messages += [{"role": "tool", "content": draw(words), "tool_call_id": c["id"]} for c in calls]
        messages += [{"role": "assistant", "content": draw(words)}, {"role": "user", "content": draw(words)}]
    return messages, [ToolSpec(name, description, json.dumps(schema)) for name, description, schema in tools]


def hf_messages(messages: list[dict]) -> list[dict]:
    """The OpenAI-style history transformers takes, written independently of Tandem's conversion."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": json.loads(c["arguments_json"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


def tiny_tokenizers(template: str) -> tuple[TokenizerBundle, PreTrainedTokenizerFast]:
    core = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = template
    return TokenizerBundle(core, template, "<s>", "</s>", add_bos_token=False), hf


@pytest.mark.parametrize("template_file", sorted(FAMILIES))
@SETTINGS
@given(data=st.data())
def test_rendered_prompt_equals_transformers(template_file, data):
    template = (FIXTURES / template_file).read_text()
    bundle, hf = tiny_tokenizers(template)
    setup = choose_chat_setup(template)
    assert setup.renders_tools and setup.source == "model" and setup.tool_parser
    messages, tools = data.draw(conversations(FAMILIES[template_file]))
    request = ToolRequest(tuple(tools))
    plan = plan_tools(request, setup, structured=None)
    ours = InputProcessor(bundle, chat_setup=setup).render(ChatPrompt(messages, tools=request), plan)
    theirs = hf.apply_chat_template(hf_messages(messages), tools=plan.template_tools, tokenize=False,
                                    add_generation_prompt=True)
    assert ours == theirs


@given(messages=st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), words), min_size=1, max_size=5),
       add_generation_prompt=st.booleans())
@SETTINGS
def test_the_smollm2_tools_template_renders_plain_chats_as_the_models_own(tokenizer, messages, add_generation_prompt):
    messages = [{"role": role, "content": content} for role, content in messages]
    shipped = InputProcessor(tokenizer)
    assert shipped.chat_setup.source == "shipped:smollm2_tools.jinja" and shipped.chat_setup.tool_parser == "hermes"
    own = InputProcessor(tokenizer, chat_setup=choose_chat_setup(None, template_file=_own_template(tokenizer)))
    prompt = ChatPrompt(messages, add_generation_prompt=add_generation_prompt)
    assert shipped.render(prompt) == own.render(prompt)


def _own_template(tokenizer, _cache={}) -> Path:
    if "path" not in _cache:
        import tempfile
        path = Path(tempfile.mkdtemp()) / "own.jinja"
        path.write_text(tokenizer.chat_template)
        _cache["path"] = path
    return _cache["path"]


def test_the_shipped_template_is_in_the_package_data():
    import tomllib
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["services.frontend.chat"]
    assert (TEMPLATES / "smollm2_tools.jinja").is_file() and "templates/*.jinja" in patterns
