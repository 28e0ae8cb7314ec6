"""Scripted model output for the tool-parser tests: text and calls written in each parser's syntax."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

TOOL_NAMES = ("get_weather", "search", "add_numbers")
UNKNOWN_NAMES = ("launch_rockets",)

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text("abcxyz_", min_size=1, max_size=5), inner, max_size=3), max_leaves=8)
arguments = st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), json_values, max_size=4)
# Text the user sees: letters, spaces and characters that begin tags and JSON, but no whole tag.
plain_text = st.text(st.sampled_from(list("ab \n.<>[]{}:;_\"'(")), min_size=1, max_size=12).filter(
    lambda t: t.strip() and t == t.strip())


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict

    @property
    def known(self) -> bool:
        return self.name in TOOL_NAMES


calls = st.builds(Call, st.sampled_from(TOOL_NAMES), arguments)
maybe_unknown_calls = st.builds(Call, st.sampled_from(TOOL_NAMES + UNKNOWN_NAMES), arguments)


def hermes(text_before: str, calls: list[Call], text_after: str, spaced: bool) -> str:
    sep = "\n" if spaced else ""
    body = sep.join(f"<tool_call>{sep}{json.dumps({'name': c.name, 'arguments': c.arguments})}{sep}</tool_call>"
                    for c in calls)
    return f"{text_before}{sep}{body}{sep}{text_after}"


def mistral(text_before: str, calls: list[Call], text_after: str, spaced: bool) -> str:
    items = [{"name": c.name, "arguments": c.arguments} for c in calls]
    return f"{text_before}[TOOL_CALLS]{json.dumps(items, indent=1 if spaced else None)}{text_after}"


def llama3_json(calls: list[Call], spaced: bool) -> str:
    objects = [json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls]
    return ("<|python_tag|>" if spaced else "") + ("; " if spaced else ";").join(objects)


def pythonic(calls: list[Call], spaced: bool) -> str:
    def literal(value) -> str:
        return repr(value)  # json values are Python literals too (None/True/False spelled as Python)
    items = [f"{c.name}({', '.join(f'{k}={literal(v)}' for k, v in c.arguments.items())})" for c in calls]
    return "[" + (", " if spaced else ",").join(items) + "]"
