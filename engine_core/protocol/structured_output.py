"""A constraint on the whole output (StructuredOutput), its llguidance grammar text and the check that
it compiles; torch-free.

Both sides use it: `validate_sampling_params` compiles the constraint where a request enters (so a
schema, regex or grammar that does not compile is INVALID_ARGUMENT with llguidance's message
before the engine sees it), and the engine compiles the same text against its vocabulary,
caching by that text (engine_core/structured/masks.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output (tandem.v1.StructuredOutput): set exactly one of the first five.

    The engine masks every token the constraint cannot continue with (engine_core/structured/).
    """

    json_schema: str | None = None  # a JSON Schema document as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: tuple[str, ...] | None = None  # exactly one of these
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)
    whitespace_flexible: bool = False  # JSON: free whitespace between tokens (default compact)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def constraints(self) -> list[str]:
        """The names of the constraints that are set (valid: exactly one)."""
        return [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint's name (call on validated params)."""
        return self.constraints[0]


CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")


_ANY_OBJECT = '{"type": "object"}'


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for a checked constraint (its text is the engine's cache key)."""
    kind = structured.kind
    if kind in ("json_schema", "json_object"):
        schema = structured.json_schema if kind == "json_schema" else _ANY_OBJECT
        # defaults, not overrides: a schema's own "x-guidance" options still win
        return LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": bool(structured.whitespace_flexible)})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(structured.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(structured.choice))
    return LLMatcher.grammar_from_lark(structured.grammar)


def check_structured_output(structured: StructuredOutput) -> None:
    """Exactly one well-formed constraint that compiles; ValueError naming the field otherwise."""
    names = structured.constraints
    if not names:
        raise ValueError("structured sets no constraint: set one of json_schema, json_object, regex, choice "
                         "or grammar (or leave structured unset)")
    if len(names) > 1:
        raise ValueError(f"structured sets {' and '.join(names)}: set exactly one constraint")
    kind = names[0]
    _check_shape(kind, structured)
    error = _compile_error(grammar_text(structured))
    if error:
        raise ValueError(f"structured.{kind} does not compile: {error}")


def _check_shape(kind: str, structured: StructuredOutput) -> None:
    value = getattr(structured, kind)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured.json_object must be true or false, got {value!r}")
        return
    if kind == "choice":
        if not value:
            raise ValueError("structured.choice.options is empty: give at least one option")
        for i, option in enumerate(value):
            if not isinstance(option, str) or not option:
                raise ValueError(f"structured.choice.options[{i}] must be a non-empty string, got {option!r}")
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured.{kind} must be a non-empty string, got {value!r}")
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured.json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured.json_schema must be a JSON object (a schema), got {type(schema).__name__}")


@functools.lru_cache(maxsize=256)
def _compile_error(grammar: str) -> str:
    """llguidance's error for `grammar`, '' when it compiles (warnings do not count)."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if is_error else ""
