"""Render a model's own chat template (jinja2, sandboxed) the way Hugging Face does; for the frontend and the
offline LLM's chat()."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this template (bad input, not a server bug)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's tojson: plain json.dumps (jinja's own escapes HTML and sorts keys), so tools
    render into the prompt exactly as transformers renders them."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra,
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); `extra` (e.g. tools) goes to
    the template as variables."""
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
