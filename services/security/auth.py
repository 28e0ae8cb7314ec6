"""Bearer tokens: `authorization: Bearer <token>` metadata checked by a grpc.aio server interceptor.

Which token a method needs depends on its service:
  - open services (health, reflection) need none, so probes and grpcurl's `list` keep working;
  - admin services need the admin token when one is set, else the API token;
  - every other service needs the API token when one is set.
Tokens are compared in constant time (hmac.compare_digest) and never echoed back.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
ADMIN_SERVICES = ("tandem.v1.AdminService",)


class TokenError(ValueError):
    """A token file is missing, unreadable or empty."""


def load_token(path: str | Path | None, env_var: str, *, flag: str) -> str | None:
    """The token from the file at `path` (given with `flag`), else from `env_var`; None when neither is set."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"{flag}: cannot read {path} ({exc.strerror or exc})") from None
        if not token:
            raise TokenError(f"{flag}: {path} is empty; put the token on its first line")
        return token
    return os.environ.get(env_var, "").strip() or None


@dataclass(frozen=True)
class Rejection:
    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class TokenPolicy:
    """The tokens a server accepts; a None token leaves its services open."""

    api_token: str | None = None
    admin_token: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.api_token or self.admin_token)

    def check(self, method: str, metadata) -> Rejection | None:
        """None when `metadata` may call `method` ("/package.Service/Method"), else why not."""
        service = method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES:
            return None
        is_admin = service in ADMIN_SERVICES
        expected, which = ((self.admin_token, "admin token") if is_admin and self.admin_token
                           else (self.api_token, "API token"))
        if expected is None:
            return None
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                             f"{service} needs the {which}: send metadata 'authorization: Bearer <token>'")
        scheme, _, presented = values[0].partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                             f"authorization metadata must be 'Bearer <token>' (the {which} of {service})")
        if not hmac.compare_digest(presented.strip().encode(), expected.encode()):
            return Rejection(grpc.StatusCode.UNAUTHENTICATED, f"the bearer token is not the {which} of {service}")
        return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends calls that lack the token their service needs with UNAUTHENTICATED, before the servicer runs."""

    def __init__(self, policy: TokenPolicy) -> None:
        self.policy = policy

    async def intercept_service(self, continuation, handler_call_details):
        rejection = self.policy.check(handler_call_details.method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if rejection is None or handler is None:
            return handler
        return _refusing(handler, rejection)


def _refusing(handler: grpc.RpcMethodHandler, rejection: Rejection) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `rejection`."""

    async def refuse(request_or_iterator, context):
        await context.abort(rejection.code, rejection.message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
