"""The one-shot client commands of `tandem`: generate, tokenize, embed, info, health (admin: admin_command.py).

Each takes the parsed arguments and returns the exit code; TandemError propagates to cli.main,
which prints "tandem: CODE: message".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from google.protobuf.json_format import MessageToDict

from clients.admin import engine_state, server_state
from clients.cli.options import client_from_args, lora_from_args, sampling_from_args


def generate(args: argparse.Namespace) -> int:
    prompt = _parse_ids(args.token_ids, "--token-ids") if args.token_ids else args.prompt
    if prompt is None:
        raise ValueError("give a prompt, or --token-ids")
    options = {**sampling_from_args(args), **lora_from_args(args)}
    if args.n != 1:
        options["n"] = args.n
    if args.request_id:
        options["request_id"] = args.request_id
    labelled = _LabelledCompletions() if args.n > 1 and not args.json else None
    with client_from_args(args) as client:
        started, first, usage, finish = time.perf_counter(), None, None, None
        for chunk in client.generate(prompt, **options):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - started
            if args.json:
                for line in _json_lines(chunk):
                    print(line, flush=True)
            elif labelled is not None:
                labelled.add(chunk)
            else:
                print(chunk.text, end="", flush=True)
            usage, finish = chunk.usage or usage, chunk.finish_reason or finish
        if labelled is None and not args.json:
            print()
    _print_stats(usage, None if labelled else finish, first, time.perf_counter() - started)  # n > 1: in the labels
    return 0


def _json_lines(chunk) -> list[str]:
    """One JSON object per completion in a streamed message (one per message unless --n > 1)."""
    usage = chunk.usage and vars(chunk.usage)
    lines = [json.dumps({"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish_reason": c.finish_reason, "usage": usage}) for c in chunk.completions]
    if not lines and usage:
        lines.append(json.dumps({"usage": usage}))
    return lines


class _LabelledCompletions:
    """--n > 1: each completion's deltas are gathered and it is printed, labelled, once it finishes."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}

    def add(self, chunk) -> None:
        for c in chunk.completions:
            self.texts.setdefault(c.index, []).append(c.text)
            if c.finish_reason:
                print(f"--- completion {c.index} (finish: {c.finish_reason}) ---", flush=True)
                print("".join(self.texts.pop(c.index)), flush=True)


def tokenize(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        if args.decode:
            text = client.detokenize(_parse_ids(" ".join(args.decode), "--decode"),
                                     skip_special_tokens=not args.keep_special)
            print(json.dumps({"text": text}) if args.json else text)
            return 0
        if args.text is None:
            raise ValueError("give the text to tokenize, or --decode IDS")
        add_special = False if args.no_special else None
        if args.chat:
            tokens = client.tokenize(messages=[{"role": "user", "content": args.text}],
                                     add_special_tokens=add_special)
        else:
            tokens = client.tokenize(args.text, add_special_tokens=add_special)
    if args.json:
        print(json.dumps({"token_ids": list(tokens.token_ids), "tokens": list(tokens.tokens),
                          "max_model_len": tokens.max_model_len}))
    else:
        print(" ".join(map(str, tokens.token_ids)))
        print(" ".join(repr(t) for t in tokens.tokens))
        print(f"{len(tokens.token_ids)} tokens (max_model_len {tokens.max_model_len})", file=sys.stderr)
    return 0


def embed(args: argparse.Namespace) -> int:
    inputs = list(args.texts) + [_parse_ids(ids, "--ids") for ids in args.ids]
    if not inputs:
        raise ValueError("give at least one TEXT or --ids to embed")
    with client_from_args(args) as client:
        result = client.embed(inputs, pooling=args.pooling, normalize=not args.no_normalize)
    print(json.dumps({"request_id": result.request_id, "embeddings": [list(v) for v in result.embeddings],
                      "num_prompt_tokens": list(result.num_prompt_tokens),
                      "usage": {"prompt_tokens": result.usage.prompt_tokens,
                                "cached_tokens": result.usage.cached_tokens}}))
    return 0


def info(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        model, server = client.model_info(), client.server_info()
    if args.json:
        print(json.dumps({"model": _as_json(model), "server": _as_json(server)}, indent=2))
        return 0
    print(f"model          {model.model_name}  ({model.model_path})")
    print(f"max_model_len  {model.max_model_len}")
    print(f"vocab_size     {model.vocab_size}   eos ids {list(model.eos_token_ids)}")
    print(f"chat template  {'yes' if model.has_chat_template else 'no'}")
    print(f"server         tandem {server.version}, {server.num_in_flight} requests in flight "
          f"(admits {server.max_waiting_requests})")
    print(f"state          {server_state(server)}")
    for engine in server.engines:
        state = f"connected, {engine_state(engine)}" if engine.connected else "DISCONNECTED"
        print(f"engine         {engine.address}  {state}, {engine.num_in_flight} in flight")
    return 0


def _as_json(message) -> dict:
    """A response as JSON with the proto's own snake_case field names, as every other --json prints."""
    return MessageToDict(message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)


def health(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        return [int(piece) for piece in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{flag} expects integers separated by spaces or commas, got {text!r}") from None


def _print_stats(usage, finish, ttft, elapsed) -> None:
    if usage is None:
        return
    rate = usage.completion_tokens / elapsed if elapsed > 0 else 0.0
    ttft_text = f"{ttft:.2f} s" if ttft is not None else "-"
    finish_text = f"finish: {finish}, " if finish else ""
    print(f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens "
          f"({usage.cached_tokens} cached), {finish_text}first token {ttft_text}, "
          f"{elapsed:.2f} s, {rate:.1f} tok/s]", file=sys.stderr)
