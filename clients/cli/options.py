"""Flags shared by the client commands of `tandem`: where the server is, TLS, token, deadline, sampling."""

from __future__ import annotations

import argparse
import json
import os

from clients.client import TandemClient
from clients.connection import DEFAULT_ADDRESS, RetryPolicy, TlsConfig

TOKEN_ENV = "TANDEM_API_TOKEN"
ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"
DEFAULT_MAX_TOKENS = 256  # when --max-tokens is not given


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the examples' line breaks and shows each flag's default once: not where the help already
    says it, and not for flags that have none (None, an off switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default in ([], ""):
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def connection_parent(default_timeout: float = 120.0,
                      token_envs: tuple[str, ...] = (TOKEN_ENV,)) -> argparse.ArgumentParser:
    """A parent parser with --address, --timeout, --retries, TLS, token and metadata flags; without
    --token-file the token comes from the first of `token_envs` that is set."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.set_defaults(token_envs=token_envs)
    group = parent.add_argument_group("connection")
    group.add_argument("--address", default=DEFAULT_ADDRESS, help="the frontend's host:port")
    group.add_argument("--timeout", type=float, default=default_timeout, metavar="S",
                       help="deadline of each call in seconds")
    group.add_argument("--retries", type=int, default=3, choices=range(5), metavar="N",
                       help="retries (exponential backoff) of a call that gets UNAVAILABLE before any response")
    group.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                       help="extra gRPC metadata on every call; repeatable (e.g. traceparent=00-...)")
    group.add_argument("--token-file", metavar="PATH",
                       help=f"send 'authorization: Bearer <token>' with the token in this file "
                            f"(default: {' or '.join('$' + name for name in token_envs)} when set)")
    tls = parent.add_argument_group("TLS (any of these turns TLS on)")
    tls.add_argument("--tls", action="store_true", help="TLS, verifying the server against the system's CAs")
    tls.add_argument("--tls-ca", metavar="PEM", help="the CA that signed the server's certificate")
    tls.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (needs --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    tls.add_argument("--tls-server-name", metavar="NAME", help="the name the server's certificate must carry")
    return parent


def sampling_parent() -> argparse.ArgumentParser:
    """A parent parser with the common sampling flags (all optional: the server applies its defaults)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("sampling (unset flags get the server's defaults)")
    group.add_argument("--max-tokens", type=int, metavar="N",
                       help=f"most tokens to generate; an N the context has no room for after the prompt is refused "
                            f"unless --clamp-max-tokens (default: {DEFAULT_MAX_TOKENS}, fewer where the context has "
                            f"less room)")
    group.add_argument("--clamp-max-tokens", action="store_true", default=None,
                       help="cut --max-tokens to the room the context has left instead of failing")
    group.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (server default 1.0)")
    group.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling, (0, 1]")
    group.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely tokens")
    group.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the top probability")
    group.add_argument("--seed", type=int, help="seeded sampling: the same seed gives the same text")
    group.add_argument("--stop", action="append", metavar="TEXT", help="stop string; repeatable")
    group.add_argument("--repetition-penalty", type=float, metavar="R", help="(0, 2], 1 = off")
    group.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    group.add_argument("--no-speculative", dest="speculative", action="store_false", default=None,
                       help="no speculative decoding for this request, where the engine speculates (the text is the "
                            "same either way)")
    structured = parent.add_argument_group("structured output (at most one; the server enforces it token by token)")
    structured.add_argument("--json-schema", metavar="FILE",
                            help="the output is JSON valid under this JSON Schema file")
    structured.add_argument("--json-object", action="store_true", default=None, help="the output is a JSON object")
    structured.add_argument("--regex", metavar="R", help="the whole output matches this regular expression")
    structured.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these; repeatable")
    structured.add_argument("--grammar", metavar="FILE", help="the output parses under this Lark grammar file")
    structured.add_argument("--whitespace-flexible", action="store_true", default=None,
                            help="JSON with free whitespace (default: compact JSON)")
    return parent


def sampling_from_args(args: argparse.Namespace) -> dict:
    """Sampling keywords for the client from the flags (the files of --json-schema and --grammar read)."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
             "ignore_eos", "clamp_max_tokens", "speculative", "json_object", "regex", "choice", "whitespace_flexible")
    sampling = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if "max_tokens" not in sampling:  # a default nobody asked for must not fail a long conversation
        sampling.update(max_tokens=DEFAULT_MAX_TOKENS, clamp_max_tokens=True)
    kinds = ("json_schema", "json_object", "regex", "choice", "grammar")
    constraints = [f"--{name.replace('_', '-')}" for name in kinds if getattr(args, name, None) is not None]
    if len(constraints) > 1:
        raise ValueError(f"give at most one of {', '.join(constraints)}")
    for name in ("json_schema", "grammar"):
        if getattr(args, name, None) is not None:
            sampling[name] = _read_text(f"--{name.replace('_', '-')}", getattr(args, name))
    return sampling


def lora_from_args(args: argparse.Namespace) -> dict:
    """lora_name for the client when --lora is given (none: the base model)."""
    return {"lora_name": args.lora} if getattr(args, "lora", None) else {}


def tools_from_args(args: argparse.Namespace) -> dict:
    """tools (the --tools file: a JSON list of tools) and tool_choice for the client, when given."""
    if getattr(args, "tools", None) is None:
        if getattr(args, "tool_choice", None) is not None:
            raise ValueError("--tool-choice needs --tools")
        return {}
    try:
        tools = json.loads(_read_text("--tools", args.tools))
    except json.JSONDecodeError as e:
        raise ValueError(f"--tools: {args.tools} is not JSON ({e})") from None
    if not isinstance(tools, list):
        raise ValueError(f"--tools: {args.tools} must hold a JSON list of tools, got {type(tools).__name__}")
    choice = args.tool_choice
    if choice is not None and choice not in ("auto", "none", "required"):
        choice = {"name": choice}
    return {"tools": tools, **({"tool_choice": choice} if choice is not None else {})}


def _read_text(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path} ({e.strerror})") from None


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name):
        return None
    return TlsConfig(root_ca=args.tls_ca, client_cert=args.tls_cert, client_key=args.tls_key,
                     server_name=args.tls_server_name)


def metadata_from_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    pairs = []
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata expects KEY=VALUE, got {item!r}")
        pairs.append((key.strip(), value))
    return pairs


def token_from_args(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.readline().strip()
        except OSError as e:
            raise ValueError(f"--token-file: cannot read {args.token_file} ({e.strerror})") from None
        if not token:
            raise ValueError(f"--token-file: {args.token_file} is empty")
        return token
    names = getattr(args, "token_envs", (TOKEN_ENV,))
    return next((token for name in names if (token := os.environ.get(name, "").strip())), None)


def client_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Keyword arguments for TandemClient / AsyncTandemClient from the connection flags."""
    return {"address": args.address, "tls": tls_from_args(args), "retry": RetryPolicy(retries=args.retries),
            "timeout": args.timeout, "metadata": metadata_from_args(args), "token": token_from_args(args)}


def client_from_args(args: argparse.Namespace) -> TandemClient:
    return TandemClient(**client_kwargs_from_args(args))
