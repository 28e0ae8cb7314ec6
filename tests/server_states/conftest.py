"""A real engine server (tiny random Llama, on its own loop thread) and a real frontend on loopback, from
tests/observability's harness; `make_stack()` builds one per test and shuts it down afterwards."""

from __future__ import annotations

from tests.observability.conftest import make_stack, observed_engine_config, tokenizer  # noqa: F401
