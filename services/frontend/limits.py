"""Request limits: the caps on n, max_tokens, prompt length, stop strings and structured-output
constraints (schema / grammar size, regex length, choice count), in one place.

Each cap has a flag on tandem-frontend; a request over one gets INVALID_ARGUMENT naming the
field, its value, the cap and the flag. Caps left unset fall back to the model's max_model_len.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_core.protocol import SamplingParams

DEFAULT_MAX_N = 16
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_STRING_CHARS = 256
DEFAULT_MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema, a grammar, or all choice options together
DEFAULT_MAX_REGEX_CHARS = 4096
DEFAULT_MAX_CHOICES = 256
DEFAULT_MAX_TOOL_CALLS = 16  # calls one completion may be forced to make (tool_choice required)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for."""

    max_n: int = DEFAULT_MAX_N  # completions per request
    max_tokens: int | None = None  # generated tokens per completion; None: up to max_model_len
    max_prompt_tokens: int | None = None  # prompt tokens; None: up to max_model_len - 1
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES
    max_regex_chars: int = DEFAULT_MAX_REGEX_CHARS
    max_choices: int = DEFAULT_MAX_CHOICES
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS

    def check_sampling(self, params: SamplingParams) -> None:
        """The caps on n, max_tokens and stop strings; ValueError naming the field, its value, the cap and
        the flag. Runs before validate_sampling_params (which checks the ranges and types)."""
        if isinstance(params.n, int) and not 1 <= params.n <= self.max_n:
            raise ValueError(f"n must be in [1, {self.max_n}] (the server's --max-n), got {params.n}")
        cap = self.max_tokens
        if cap is not None and isinstance(params.max_tokens, int) and not 1 <= params.max_tokens <= cap:
            raise ValueError(f"max_tokens must be in [1, {cap}] (the server's --max-tokens), got {params.max_tokens}")
        if len(params.stop) > self.max_stop_strings:
            raise ValueError(f"stop has {len(params.stop)} strings; at most {self.max_stop_strings} are allowed "
                             "(the server's --max-stop-strings)")
        for i, stop in enumerate(params.stop):
            if isinstance(stop, str) and len(stop) > self.max_stop_string_chars:
                raise ValueError(f"stop[{i}] is {len(stop)} characters long; at most {self.max_stop_string_chars} "
                                 "are allowed (the server's --max-stop-string-length)")
        if params.structured is not None:
            self._check_structured(params.structured)

    def _check_structured(self, structured) -> None:
        """The sizes of a constraint (compiling it is validate_sampling_params' job, after this)."""
        for kind in ("json_schema", "grammar"):
            text = getattr(structured, kind)
            if isinstance(text, str) and len(text.encode()) > self.max_schema_bytes:
                raise ValueError(f"structured.{kind} is {len(text.encode())} bytes; at most {self.max_schema_bytes} "
                                 "are allowed (the server's --max-schema-bytes)")
        if isinstance(structured.regex, str) and len(structured.regex) > self.max_regex_chars:
            raise ValueError(f"structured.regex is {len(structured.regex)} characters long; at most "
                             f"{self.max_regex_chars} are allowed (the server's --max-regex-length)")
        options = structured.choice or ()
        if len(options) > self.max_choices:
            raise ValueError(f"structured.choice.options has {len(options)} options; at most {self.max_choices} "
                             "are allowed (the server's --max-choices)")
        size = sum(len(o.encode()) for o in options if isinstance(o, str))
        if size > self.max_schema_bytes:
            raise ValueError(f"structured.choice.options are {size} bytes together; at most {self.max_schema_bytes} "
                             "are allowed (the server's --max-schema-bytes)")

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("request limits")
        group.add_argument("--max-n", type=_positive, default=DEFAULT_MAX_N,
                           help="the largest n (completions per request) accepted (default: %(default)s)")
        group.add_argument("--max-tokens", type=_positive, default=None,
                           help="the largest max_tokens accepted, and the value when a request leaves it unset "
                                "(default: up to the model's max_model_len)")
        group.add_argument("--max-prompt-tokens", type=_positive, default=None,
                           help="the longest prompt accepted, in tokens (default: max_model_len - 1)")
        group.add_argument("--max-stop-strings", type=_positive, default=DEFAULT_MAX_STOP_STRINGS,
                           help="the most stop strings per request (default: %(default)s)")
        group.add_argument("--max-stop-string-length", type=_positive, default=DEFAULT_MAX_STOP_STRING_CHARS,
                           help="the longest stop string accepted, in characters (default: %(default)s)")
        group.add_argument("--max-schema-bytes", type=_positive, default=DEFAULT_MAX_SCHEMA_BYTES,
                           help="the largest structured-output JSON schema or grammar accepted, in bytes "
                                "(also all choice options together; default: %(default)s)")
        group.add_argument("--max-regex-length", type=_positive, default=DEFAULT_MAX_REGEX_CHARS,
                           help="the longest structured-output regex accepted, in characters (default: %(default)s)")
        group.add_argument("--max-choices", type=_positive, default=DEFAULT_MAX_CHOICES,
                           help="the most structured-output choice options accepted (default: %(default)s)")
        group.add_argument("--max-tool-calls", type=_positive, default=DEFAULT_MAX_TOOL_CALLS,
                           help="the most calls tool_choice required forces into one completion (the array's "
                                "maxItems; default: %(default)s)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(max_n=args.max_n, max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                   max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_length,
                   max_schema_bytes=args.max_schema_bytes, max_regex_chars=args.max_regex_length,
                   max_choices=args.max_choices, max_tool_calls=args.max_tool_calls)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
