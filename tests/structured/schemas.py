"""Constraints the structured-output tests share, each with the check its outputs must pass."""

from __future__ import annotations

import json
import re

import jsonschema
import lark

PERSON = {  # nested object, array, enum, required fields, bounded numbers
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
MEASUREMENTS = {  # an array of objects with bounded floats and booleans
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "sensor": {"enum": ["temp", "humidity"]},
            "value": {"type": "number", "minimum": -40, "maximum": 60},
            "ok": {"type": "boolean"},
        },
        "required": ["sensor", "value", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
ORDER = {  # nested arrays and integers with exclusive bounds
    "type": "object",
    "properties": {
        "id": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99999},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "lines", "paid"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "measurements": MEASUREMENTS, "order": ORDER}

PHONE_REGEX = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"  # [0-9]: \\d is any Unicode digit in Rust regex
CHOICES = ("positive", "negative", "neutral")
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def check_json(text: str, schema: dict) -> None:
    """The text is JSON and validates against the schema (raises otherwise)."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, pattern: str = PHONE_REGEX) -> None:
    assert re.fullmatch(pattern, text), f"{text!r} does not fully match {pattern!r}"


def check_lark(text: str, grammar: str = ARITHMETIC) -> None:
    lark.Lark(grammar, parser="earley").parse(text)
