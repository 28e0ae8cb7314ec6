"""`tandem bench`: load a Tandem frontend (or Tandem and its peers side by side) and report.

Prompts are made first (through the server's Tokenize for exact token lengths), then each
sweep point runs with a progress bar on stderr; at the end a table is printed, the results
are written as JSON and, for sweeps, a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

from clients.async_client import AsyncTandemClient
from clients.bench import side_by_side
from clients.bench.backends import LlamaServerBackend, TandemBackend
from clients.bench.loadgen import closed_loop, open_loop
from clients.bench.metrics import summarize
from clients.bench.plot import plot_sweep
from clients.bench.prompts import BenchPrompt, jsonl_prompts, repeat_to, synthetic_prompts
from clients.bench.report import format_table, write_json
from clients.cli.options import HelpFormatter, client_from_args, client_kwargs_from_args, positive_int

EXAMPLES = """examples:
  tandem bench                                         # 32 requests, 1 at a time, 128 in / 128 out tokens
  tandem bench --concurrency 1 4 16 --num-requests 64  # closed-loop sweep; writes JSON and a PNG plot
  tandem bench --rate 0.5 1 2 --num-requests 50 --seed 3          # open loop: Poisson arrivals per second
  tandem bench --prompts-file prompts.jsonl --concurrency 8       # {"prompt": "...", "max_tokens": 64} per line
  tandem bench --side-by-side --concurrency 1 8 --llama-server http://127.0.0.1:8080
                                                       # + in-process engine, transformers, llama.cpp; ratios"""


def add_parser(subcommands, connection: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = subcommands.add_parser(
        "bench", help="benchmark a frontend: TTFT, ITL, TPOT, e2e, throughput",
        description=__doc__.strip(), epilog=EXAMPLES, parents=[connection],
        formatter_class=HelpFormatter)
    load = parser.add_argument_group("load").add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_int, nargs="+", metavar="N",
                      help="closed loop: N requests in flight; several values sweep (default: 1)")
    load.add_argument("--rate", type=_positive_float, nargs="+", metavar="R",
                      help="open loop: Poisson arrivals at R requests/s; several values sweep")
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--num-requests", type=positive_int, default=32, metavar="N", help="requests per point")
    prompts.add_argument("--input-len", type=positive_int, default=128, metavar="T", help="synthetic prompt tokens")
    prompts.add_argument("--output-len", type=positive_int, default=128, metavar="T",
                         help="tokens generated per request (greedy, EOS ignored)")
    prompts.add_argument("--words", action="store_true",
                         help="synthetic prompts of --input-len words (no Tokenize calls) instead of tokens")
    prompts.add_argument("--prompts-file", metavar="JSONL",
                         help='prompts from a file: {"prompt": text} or {"token_ids": [...]}, optional "max_tokens"')
    prompts.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and the arrivals")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default="bench_results/bench.json", metavar="PATH", help="JSON results")
    out.add_argument("--plot", metavar="PNG", help="plot path (default for sweeps: --output with .png)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    peers = parser.add_argument_group("side by side")
    peers.add_argument("--side-by-side", action="store_true",
                       help="also run the frontend over an in-process engine, transformers and a llama.cpp server; "
                            "print ratios")
    peers.add_argument("--llama-server", metavar="URL", help="a llama.cpp server (OpenAI-compatible endpoint)")
    peers.add_argument("--no-in-process", action="store_true", help="side by side without the in-process engine")
    peers.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizer of the in-process frontend: a .gguf or a folder with tokenizer.json "
                            "(default: the model's own)")
    peers.add_argument("--no-transformers", action="store_true", help="side by side without transformers")
    peers.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="dtype of the in-process engine and transformers")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    x_key, values = ("rate", args.rate) if args.rate else ("concurrency", args.concurrency or [1])
    with client_from_args(args) as client:
        model = client.model_info()
        point_prompts = [make_prompts(args, client, args.seed + i) for i in range(len(values))]
        if args.side_by_side:
            point_prompts = [side_by_side.with_token_ids(client, p) for p in point_prompts]
    check_lengths(point_prompts, model.max_model_len)
    result = {"benchmark": "tandem bench", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "address": args.address, "model": model.model_name, "model_path": model.model_path,
              "mode": "open loop" if x_key == "rate" else "closed loop", "x": x_key,
              "prompts": {"source": args.prompts_file or ("synthetic words" if args.words else "synthetic tokens"),
                          "num_requests": args.num_requests, "input_len": args.input_len,
                          "output_len": args.output_len, "seed": args.seed}}
    series = {"tandem-grpc": run_points(args, lambda: TandemBackend(AsyncTandemClient(**client_kwargs_from_args(args))),
                                        x_key, values, point_prompts)}
    if args.side_by_side:
        run_peers(args, model, x_key, values, point_prompts, series, result)
    result["series"] = series
    result["sweep"] = series["tandem-grpc"]
    print_tables(series, x_key)
    if args.side_by_side:
        print_ratios(result)
    print(f"wrote {write_json(args.output, result)}")
    plot_path = args.plot or (Path(args.output).with_suffix(".png") if len(values) > 1 else None)
    if plot_path:
        title = f"{model.model_name}: {result['mode']}, {result['prompts']['source']}"
        print(f"wrote {plot_sweep(series, x_key, plot_path, title)}")
    return 0


# ---- prompts -----------------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace, client, seed: int) -> list[BenchPrompt]:
    if args.prompts_file:
        return repeat_to(jsonl_prompts(args.prompts_file, args.output_len), args.num_requests)
    if args.words:
        return synthetic_prompts(args.num_requests, args.input_len, args.output_len, seed)
    return synthetic_prompts(args.num_requests, args.input_len, args.output_len, seed,
                             tokenize=lambda text: client.tokenize(text, add_special_tokens=False).token_ids,
                             detokenize=client.detokenize)


def check_lengths(point_prompts: list[list[BenchPrompt]], max_model_len: int) -> None:
    for prompts in point_prompts:
        for p in prompts:
            if p.num_tokens is not None and p.num_tokens + p.max_tokens > max_model_len:
                raise ValueError(f"a prompt of {p.num_tokens} tokens + {p.max_tokens} generated tokens does not fit "
                                 f"the model's max_model_len {max_model_len}; lower --input-len or --output-len")


# ---- running --------------------------------------------------------------------------------------------
def run_points(args, make_backend, x_key: str, values: list, point_prompts: list[list[BenchPrompt]]) -> list[dict]:
    """Every sweep point against one backend (made inside the event loop), with a warm-up first."""

    async def main() -> list[dict]:
        backend = make_backend()
        try:
            warmup = replace(point_prompts[0][0], max_tokens=2)
            await closed_loop(backend, [warmup], 1)
            points = []
            for value, prompts in zip(values, point_prompts):
                with progress_bar(args, f"{backend.name} {x_key}={value}", len(prompts)) as bar:
                    if x_key == "rate":
                        records, wall = await open_loop(backend, prompts, value, args.seed, bar.tick)
                    else:
                        records, wall = await closed_loop(backend, prompts, value, bar.tick)
                points.append({x_key: value, **summarize(records, wall)})
            return points
        finally:
            await backend.close()

    return asyncio.run(main())


def run_peers(args, model, x_key, values, point_prompts, series: dict, result: dict) -> None:
    notes = side_by_side.peers_available(model.model_path, args.llama_server, not args.no_in_process,
                                         not args.no_transformers, args.tokenizer)
    longest = max(p.num_tokens + p.max_tokens for prompts in point_prompts for p in prompts)
    if "in-process" not in notes:
        series["in-process"] = run_points(args, lambda: side_by_side.make_in_process_backend(
            model.model_path, args.tokenizer or model.model_path, args.dtype, longest + 16,
            max(values) if x_key == "concurrency" else 256),
            x_key, values, point_prompts)
    if "transformers" not in notes and x_key == "rate":
        notes["transformers"] = "skipped: static batches have no open-loop mode"
    if "transformers" not in notes:
        series["transformers"] = run_transformers(args, model.model_path, values, point_prompts)
    if "llama.cpp-server" not in notes:
        series["llama.cpp-server"] = run_points(args, lambda: LlamaServerBackend(args.llama_server), x_key, values,
                                                point_prompts)
    result["skipped"] = notes
    result["ratios"] = [
        {x_key: point[x_key], **{f"vs {name}": side_by_side.ratios(point, points[i])
                                 for name, points in series.items() if name != "tandem-grpc"}}
        for i, point in enumerate(series["tandem-grpc"])
    ]


def run_transformers(args, model_path: str, values: list, point_prompts) -> list[dict]:
    import torch

    from clients.bench.transformers_peer import load_transformers

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = load_transformers(model_path, dtype)
    points = []
    for value, prompts in zip(values, point_prompts):
        with progress_bar(args, f"transformers concurrency={value}", len(prompts)) as bar:
            records, wall = side_by_side.transformers_closed_loop(model, prompts, value, bar.tick)
        points.append({"concurrency": value, **summarize(records, wall)})
    return points


class progress_bar:  # noqa: N801 - used as a context manager, like open()
    """A tqdm bar on stderr (nothing with --no-progress); `tick()` counts one finished request."""

    def __init__(self, args, description: str, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=description, unit="req", file=sys.stderr, leave=False,
                         disable=args.no_progress, dynamic_ncols=True)

    def tick(self) -> None:
        self._bar.update(1)

    def __enter__(self) -> "progress_bar":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


# ---- reporting ----------------------------------------------------------------------------------------
def print_tables(series: dict[str, list[dict]], x_key: str) -> None:
    rows = [(f"{name} {point[x_key]}" if len(series) > 1 else str(point[x_key]), point)
            for name, points in series.items() for point in points]
    label = f"backend {x_key}" if len(series) > 1 else x_key
    print(format_table(rows, label))


def print_ratios(result: dict) -> None:
    x_key = result["x"]
    print("\nTandem over gRPC / peer (throughput: higher is better; latency: lower is better)")
    for row in result["ratios"]:
        for peer, r in row.items():
            if peer == x_key:
                continue
            cells = [f"{name} {value:.2f}x" for name, value in r.items() if value is not None]
            print(f"  {x_key} {row[x_key]}, {peer}: {', '.join(cells) or '-'}")
    for peer, why in result["skipped"].items():
        print(f"  {peer}: {why}")



def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value
