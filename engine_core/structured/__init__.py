"""Structured output: constraints (JSON schema, regex, choice, grammar) enforced with llguidance.

grammar.py (torch-free, both sides) turns a StructuredOutput into llguidance's grammar text and
checks that it compiles; vocabulary.py builds llguidance's tokenizer from the model's own;
matcher.py follows one request's output; masks.py computes a step's token bitmasks (the
engine's StructuredOutputs); bitmask.py applies them to the logits.
"""
