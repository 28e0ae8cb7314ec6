"""The busy loop's own queue items: what a connection puts on it besides the protocol's requests.

Inputs go onto the busy loop's queue as (connection id, item): `Open`, `Close`, `Add`, `Abort`, a
`UtilityCall` or `Call`. Outputs come back to one connection's sink as the protocol's
`EngineCoreOutputs`, or `EngineDied`. `convert.py` turns protos into these and back, so the busy loop
never sees a generated class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine_core.protocol import EngineCoreRequest


@dataclass(frozen=True)
class Open:
    """A new connection; `sink` is called from the loop thread with each output item."""

    sink: Callable[[object], None]


@dataclass(frozen=True)
class Close:
    """The connection went away: abort all of its requests."""


@dataclass(frozen=True)
class Add:
    request: EngineCoreRequest  # the request id as the connection knows it


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Call:
    """Run `fn()` on the loop thread (in-process tooling and tests)."""

    fn: Callable[[], None]


@dataclass(frozen=True)
class EngineDied:
    """The busy loop crashed; the connection must end with an error."""

    error: str
