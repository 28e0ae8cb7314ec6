"""Hypothesis strategies for tool sets whose arguments a small model can finish: nested objects, enums,
arrays and required fields, every value bounded (string maxLength, array maxItems, integer ranges, no
extra properties), so a forced call ends well within max_tokens."""

from __future__ import annotations

from hypothesis import strategies as st

property_names = st.from_regex(r"[a-z][a-z_]{0,9}", fullmatch=True)
words = st.from_regex(r"[a-z]{1,8}", fullmatch=True)

leaf_schemas = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
    st.builds(lambda values: {"type": "string", "enum": values}, st.lists(words, min_size=1, max_size=4, unique=True)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
)


def objects(values) -> st.SearchStrategy[dict]:
    """An object schema: 1-4 properties drawn from `values`, a random subset required, nothing else allowed."""
    @st.composite
    def build(draw):
        properties = draw(st.dictionaries(property_names, values, min_size=1, max_size=4))
        required = [name for name in properties if draw(st.booleans())]
        schema = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema
    return build()


value_schemas = st.recursive(
    leaf_schemas,
    lambda inner: st.one_of(
        objects(inner),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(1, 3)),
    ),
    max_leaves=6,
)
parameter_schemas = objects(value_schemas)
tool_sets = st.lists(st.tuples(st.from_regex(r"[a-z][a-z_]{2,14}", fullmatch=True), words, parameter_schemas),
                     min_size=1, max_size=3, unique_by=lambda tool: tool[0])
