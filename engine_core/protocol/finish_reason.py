"""Why a completion stopped, numbered like tandem.v1.FinishReason so it crosses the wire as is."""

from __future__ import annotations

import enum


class FinishReason(enum.IntEnum):
    STOP = 1  # EOS, a stop token id or (frontend) a stop string
    LENGTH = 2  # max_tokens or max_model_len reached
    ABORT = 3  # aborted by the client, the frontend or a shutdown
    TOOL_CALLS = 4  # stopped after calling tools (the frontend's tool parser says so; never the engine)

    def __str__(self) -> str:
        return self.name.lower()
