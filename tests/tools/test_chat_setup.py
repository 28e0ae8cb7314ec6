"""Which template and parser the frontend picks: the model's own with a tools branch, the shipped SmolLM2
one instead of a template without, a --chat-template file over both, --tool-parser over the guess."""

from __future__ import annotations

import pytest

from services.frontend.__main__ import parse_args
from services.frontend.chat.template_choice import choose_chat_setup, effective_chat_template
from tests.tools.test_template_golden import FIXTURES

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def test_a_template_with_a_tools_branch_is_kept_and_picks_its_parser():
    qwen = (FIXTURES / "qwen2_5.jinja").read_text()
    setup = choose_chat_setup(qwen)
    assert (setup.template, setup.source, setup.tool_parser, setup.renders_tools) == (qwen, "model", "hermes", True)


def test_smollm2_gets_the_shipped_template_and_other_templates_without_tools_stay(tokenizer):
    assert "tools" in effective_chat_template(tokenizer)
    plain = choose_chat_setup(CHATML)
    assert (plain.source, plain.renders_tools, plain.tool_parser) == ("model", False, None)


def test_a_file_and_a_parser_override_the_choice(tmp_path, tokenizer):
    path = tmp_path / "mine.jinja"
    path.write_text((FIXTURES / "llama3_2_pythonic.jinja").read_text())
    setup = choose_chat_setup(tokenizer.chat_template, template_file=path, tool_parser="hermes")
    assert setup.source == f"file:{path}" and setup.tool_parser == "hermes" and setup.renders_tools
    assert effective_chat_template(tokenizer, template_file=path) == path.read_text()
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'"):
        choose_chat_setup(CHATML, tool_parser="qwen")
    path.write_text("{% if %}")
    with pytest.raises(ValueError, match="the chat template does not parse"):
        choose_chat_setup(None, template_file=path)


def test_the_frontend_flags(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
    assert "--chat-template" in (err := capsys.readouterr().err) and "no such file" in err
    with pytest.raises(SystemExit):
        parse_args(["--tool-parser", "qwen"])
    args = parse_args(["--tool-parser", "mistral"])
    assert args.tool_parser == "mistral" and args.chat_template is None


def test_the_frontend_says_which_template_it_renders_with(stack):
    assert stack.llm.chat_template == stack.llm.input_processor.chat_setup.template
    assert "<tool_call>" in stack.llm.chat_template  # the shipped SmolLM2 tools template
