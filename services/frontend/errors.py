"""The frontend's error kinds. No gRPC here: server.py maps each to a status code."""

from __future__ import annotations


class FrontendError(Exception):
    """An error a client can act on; the message says what was wrong and what is allowed."""


class InvalidRequest(FrontendError, ValueError):
    """Bad input (INVALID_ARGUMENT): the message names the field and the allowed range."""


class TooManyRequests(FrontendError):
    """Over an admission limit (RESOURCE_EXHAUSTED): retry later."""


class SlowReader(TooManyRequests):
    """The client stopped reading its stream and too much output waited for it (RESOURCE_EXHAUSTED)."""


class NotFound(FrontendError):
    """What the request names does not exist (NOT_FOUND): a LoRA adapter no engine has loaded."""


class FailedPrecondition(FrontendError):
    """The servers' state refuses the call (FAILED_PRECONDITION): e.g. unloading an adapter in use."""


class DuplicateRequest(FrontendError):
    """A request with this id is already in flight (ALREADY_EXISTS)."""


class EngineUnavailable(FrontendError):
    """No engine can take the request, or its engine went away (UNAVAILABLE)."""


class EngineAsleep(EngineUnavailable):
    """Every engine that could take the request is asleep (UNAVAILABLE, as draining: a state of the server
    that another replica, or the same one after WakeUp, does not share; the request itself was fine)."""

    def __init__(self) -> None:
        super().__init__("the engines are asleep (AdminService/Sleep) and take no requests until an operator wakes "
                         "them (AdminService/WakeUp, `tandem admin wake`); retry later or on another replica")
