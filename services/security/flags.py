"""The security flags of tandem-engine and tandem-frontend, and the transports they build.

    --tls-cert/--tls-key [--tls-client-ca]   TLS on the listening port; with a client CA, mutual TLS
    --api-token-file / --admin-token-file     bearer tokens (or TANDEM_API_TOKEN / TANDEM_ADMIN_TOKEN)
    --engine-tls-ca/-cert/-key/-server-name   TLS to the engine cores (frontend only)
    --max-message-bytes                       the largest message received or sent

Without TLS flags a server listens in plaintext, the loopback default.
"""

from __future__ import annotations

import argparse

import grpc

from services.security.auth import BearerTokenInterceptor, TokenPolicy, load_token
from services.security.tls import TlsError, channel_credentials, server_credentials
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES, ChannelTransport, ServerTransport

API_TOKEN_ENV = "TANDEM_API_TOKEN"
ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"


# ---- the listening port ---------------------------------------------------------------
def add_server_flags(parser: argparse.ArgumentParser, *, max_message_bytes: int, tokens: bool = False) -> None:
    """TLS, size and (with `tokens`) bearer-token flags for a server's listening port."""
    group = parser.add_argument_group("security")
    group.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (needs --tls-key)")
    group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    group.add_argument("--tls-client-ca", metavar="PEM",
                       help="mutual TLS: require client certificates signed by this CA (needs --tls-cert)")
    group.add_argument("--max-message-bytes", type=_positive_int, default=max_message_bytes, metavar="N",
                       help="largest message received or sent; larger ones get RESOURCE_EXHAUSTED "
                            "(default: %(default)s)")
    if tokens:
        group.add_argument("--api-token-file", metavar="PATH",
                           help=f"require 'authorization: Bearer <token>' on the public API, the token read from "
                                f"this file (default: ${API_TOKEN_ENV} when set; else no token)")
        group.add_argument("--admin-token-file", metavar="PATH",
                           help=f"a separate token for tandem.v1.AdminService (default: ${ADMIN_TOKEN_ENV} when set; "
                                f"else admin calls need the API token)")


def server_transport_from_args(args: argparse.Namespace) -> ServerTransport:
    """The ServerTransport the flags describe; TlsError / TokenError (ValueErrors) on a bad flag or file."""
    credentials = _server_credentials(args)
    interceptors = ()
    if hasattr(args, "api_token_file"):
        policy = TokenPolicy(api_token=load_token(args.api_token_file, API_TOKEN_ENV, flag="--api-token-file"),
                             admin_token=load_token(args.admin_token_file, ADMIN_TOKEN_ENV, flag="--admin-token-file"))
        interceptors = (BearerTokenInterceptor(policy),) if policy.enabled else ()
    return ServerTransport(credentials=credentials, interceptors=interceptors,
                           max_message_bytes=args.max_message_bytes)


def _server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        missing = "--tls-key" if args.tls_cert else "--tls-cert"
        raise TlsError(f"TLS needs both --tls-cert and --tls-key; {missing} is missing")
    return server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)


# ---- the frontend's link to its engines -------------------------------------------------
def add_engine_link_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine link security")
    group.add_argument("--engine-tls-ca", metavar="PEM",
                       help="connect to the engines over TLS, trusting this CA (any --engine-tls-* flag turns TLS "
                            "on; without this one the system's roots are trusted)")
    group.add_argument("--engine-tls-cert", metavar="PEM",
                       help="mutual TLS: the frontend's client certificate (needs --engine-tls-key)")
    group.add_argument("--engine-tls-key", metavar="PEM", help="the private key of --engine-tls-cert")
    group.add_argument("--engine-tls-server-name", metavar="NAME",
                       help="the name the engines' certificates must carry (default: the host of --engine)")


def engine_link_from_args(args: argparse.Namespace) -> ChannelTransport:
    """The ChannelTransport to the engines; TlsError on a bad flag or file."""
    tls = args.engine_tls_ca or args.engine_tls_cert or args.engine_tls_key or args.engine_tls_server_name
    if not tls:
        return ChannelTransport(max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES)
    credentials = channel_credentials(args.engine_tls_ca, args.engine_tls_cert, args.engine_tls_key,
                                      flags=("--engine-tls-ca", "--engine-tls-cert", "--engine-tls-key"))
    return ChannelTransport(credentials=credentials, server_name=args.engine_tls_server_name,
                            max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {value}")
    return value
