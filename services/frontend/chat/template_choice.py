"""Which chat template the frontend renders with, and which parser reads tool calls out of the model's text.

The model's own template when it has a tools branch; for a model whose template has none but for which
Tandem ships a tool-aware one (the embedded SmolLM2), that one; --chat-template FILE and --tool-parser
NAME override both. `effective_chat_template` is the one answer to "what does this frontend render with"
(the gateway's GetTokenizer ships the same text).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from jinja2 import TemplateSyntaxError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.frontend.tokenizer import TokenizerBundle
from services.frontend.tools.parsers import PARSERS, parser_for_template

TEMPLATES = Path(__file__).parent / "templates"
# Shipped tool-aware templates for models whose own template has no tools branch: (marker in the model's
# template, file). The marker is the model's default system prompt, so only that family matches.
SHIPPED_TOOL_TEMPLATES = (("You are a helpful AI assistant named SmolLM", "smollm2_tools.jinja"),)


@dataclass(frozen=True)
class ChatSetup:
    """The template text the frontend renders chats with, where it came from, and the tool parser."""

    template: str | None
    source: str  # "model", "shipped:FILE" or "file:PATH"
    tool_parser: str | None  # a key of tools.parsers.PARSERS; None: no parser fits (tools need one)

    @property
    def renders_tools(self) -> bool:
        """The template reads a `tools` variable (it has a tools branch)."""
        return self.template is not None and "tools" in _variables(self.template)


def choose_chat_setup(model_template: str | None, *, template_file: str | Path | None = None,
                      tool_parser: str | None = None) -> ChatSetup:
    """The setup for a model's template: a file overrides it, a shipped tool template replaces one without
    a tools branch; the parser is `tool_parser` or the one the template's call syntax needs."""
    if tool_parser is not None and tool_parser not in PARSERS:
        raise ValueError(f"unknown tool parser {tool_parser!r}; choose one of {', '.join(sorted(PARSERS))}")
    if template_file is not None:
        setup = ChatSetup(Path(template_file).read_text(), f"file:{template_file}", None)
    else:
        setup = ChatSetup(model_template, "model", None)
        if model_template and not setup.renders_tools:
            shipped = next((name for marker, name in SHIPPED_TOOL_TEMPLATES if marker in model_template), None)
            if shipped is not None:
                setup = ChatSetup((TEMPLATES / shipped).read_text(), f"shipped:{shipped}", None)
    if setup.template is not None:
        _variables(setup.template)  # a template that does not parse fails at start, not on the first chat
    return ChatSetup(setup.template, setup.source, tool_parser or parser_for_template(setup.template))


def effective_chat_template(tokenizer: TokenizerBundle, *, template_file: str | Path | None = None) -> str | None:
    """The chat template text this frontend renders with for this tokenizer (and --chat-template)."""
    return choose_chat_setup(tokenizer.chat_template, template_file=template_file).template


@lru_cache(maxsize=8)
def _variables(template: str) -> frozenset[str]:
    try:
        parsed = ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(template)
        return frozenset(meta.find_undeclared_variables(parsed))
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e}") from e
