"""The frontend harness (a real frontend over a scripted fake engine) for the tool-calling tests."""

from tests.frontend.conftest import make_stack, stack, tokenizer  # noqa: F401
