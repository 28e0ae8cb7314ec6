"""TandemError: a failed call, with the gRPC status code and the server's message."""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """A call that ended with a non-OK gRPC status.

    `code` is the `grpc.StatusCode` (e.g. INVALID_ARGUMENT, UNAVAILABLE) and `message` the
    server's human-readable detail; `str(error)` is "CODE: message".
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "TandemError":
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "(no message)")
