"""Token ids in, token ids out; and, offline, vLLM's API over it:

    from engine_core import LLM, LLMEngine, EngineArgs, SamplingParams, RequestOutput, CompletionOutput

Loaded on first use (PEP 562), so that importing engine_core.protocol (the frontend does) loads neither torch
nor the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine_core.offline.llm",
    "LLMEngine": "engine_core.offline.llm_engine",
    "EngineArgs": "engine_core.engine_args",
    "EngineConfig": "engine_core.config",
    "SamplingParams": "engine_core.protocol",
    "RequestOutput": "engine_core.protocol",
    "CompletionOutput": "engine_core.protocol",
    "RequestMetrics": "engine_core.protocol",
    "OutputKind": "engine_core.protocol",
    "FinishReason": "engine_core.protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine_core' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
