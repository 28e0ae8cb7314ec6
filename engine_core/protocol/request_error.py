"""An engine's refusal of one request, and whose fault it is."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestErrorKind(enum.IntEnum):
    """Numbered like tandem.v1.RequestErrorKind (0, unspecified, is INVALID)."""

    INVALID = 0  # the request itself is bad: the client's to fix
    ASLEEP = 1  # the engine sleeps until WakeUp: a state of the server, not the client's fault
    NOT_FOUND = 2  # the request names a LoRA adapter the engine has not loaded


@dataclass(frozen=True)
class RequestError:
    request_id: str
    message: str  # says why, for a person
    kind: RequestErrorKind = RequestErrorKind.INVALID
