"""Tool calling's cost on the frontend, in one run:

1. Parse time per streamed chunk: scripted model output (text and hermes / llama3_json / mistral / pythonic
   calls) decoded token by token with the SmolLM2 tokenizer, each token's text fed to a ToolCallStreamer;
   p50 / p99 / max microseconds per chunk, in this process.
2. Streams with tools vs without, side by side: the real frontend (pinned to core 0) against the fake
   engine (tests/frontend/fake_engine.py, no model) that emits the same scripted hermes output for every
   request; N concurrent Chat streams without tools, then with tools (parsed into ToolCallDeltas).
   Tokens per second and the frontend's CPU seconds for each.

    python scripts/bench_tools.py                         # 32 streams x 2048 tokens, 2000 chunks per parser
    python scripts/bench_tools.py --streams 4 --tokens 64 --chunks 200   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
from bench_frontend import cpu_seconds, smollm2_gguf, wait_for_engine  # noqa: E402
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402

from clients.local_stack import free_port, wait_until_serving  # noqa: E402
from services.frontend.tokenizer import load_tokenizer  # noqa: E402
from services.frontend.tools.parsers import PARSERS, ToolCallStreamer  # noqa: E402

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "search": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain in Paris tomorrow", "limit": 5})]
TEXT = "Let me look that up for you. "


def scripted_output(parser: str) -> str:
    """One reply in the parser's syntax: some text (where the syntax allows), then both calls."""
    if parser == "hermes":
        return TEXT + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                              for n, a in CALLS)
    if parser == "mistral":
        return TEXT + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS])
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in CALLS) + "]"


def parse_times(tokenizer, chunks: int) -> dict:
    """Microseconds per fed chunk (one token's text), per parser."""
    results = {}
    for name, parser_class in sorted(PARSERS.items()):
        ids = tokenizer.encode(scripted_output(name), add_special_tokens=False)
        times, fed = [], 0
        while fed < chunks:
            streamer, stream = ToolCallStreamer(parser_class(frozenset(TOOLS))), DecodeStream(skip_special_tokens=False)
            for token_id in ids:
                text = stream.step(tokenizer.tokenizer, token_id) or ""
                started = time.perf_counter_ns()
                streamer.feed(text)
                times.append(time.perf_counter_ns() - started)
            started = time.perf_counter_ns()
            streamer.finish()
            times.append(time.perf_counter_ns() - started)
            assert [c.name for c in streamer.tool_calls] == [n for n, _ in CALLS], (name, streamer.tool_calls)
            fed += len(ids) + 1
        times.sort()
        results[name] = {"chunks": len(times), "p50_us": times[len(times) // 2] / 1000,
                         "p99_us": times[int(len(times) * 0.99)] / 1000, "max_us": times[-1] / 1000}
    return results


async def one_stream(stub, tokens: int, with_tools: bool) -> tuple[int, int]:
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="What is the weather in Paris?")],
        sampling_params=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                  output_kind=common_pb2.OUTPUT_KIND_DELTA))
    if with_tools:
        request.tools.extend(generation_pb2.Tool(name=n, parameters_json=json.dumps(s)) for n, s in TOOLS.items())
    received = deltas = 0
    async for response in stub.Chat(request):
        for chunk in response.completions:
            received += len(chunk.token_ids)
            deltas += len(chunk.tool_call_deltas)
    return received, deltas


async def load(address: str, streams: int, tokens: int, with_tools: bool) -> tuple[int, int, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await one_stream(stub, 8, with_tools)  # warm-up
        started = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(stub, tokens, with_tools) for _ in range(streams)))
        return sum(c[0] for c in counts), sum(c[1] for c in counts), time.perf_counter() - started


def streams_side_by_side(tokenizer, streams: int, tokens: int) -> list[dict]:
    if os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(0, {1})  # client and fake engine here, frontend on core 0
    script = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(tokenizer.encode(scripted_output("hermes"), add_special_tokens=False), script)
    script.close()
    engine_port, frontend_port = free_port(), free_port()
    engine = subprocess.Popen([sys.executable, "-m", "tests.frontend.fake_engine", "--port", str(engine_port),
                               "--model-path", smollm2_gguf(), "--max-model-len", str(tokens + 1024),
                               "--script-ids", script.name], stdout=subprocess.DEVNULL)
    frontend, rows = None, []
    try:
        wait_for_engine(f"127.0.0.1:{engine_port}")
        frontend = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, "-m", "services.frontend", "--engine", f"127.0.0.1:{engine_port}",
             "--host", "127.0.0.1", "--port", str(frontend_port), "--log-level", "WARNING"])
        address = f"127.0.0.1:{frontend_port}"
        wait_until_serving(address, 60, frontend)
        for with_tools in (False, True):
            cpu_before = cpu_seconds(frontend.pid)
            received, deltas, elapsed = asyncio.run(load(address, streams, tokens, with_tools))
            cpu = cpu_seconds(frontend.pid) - cpu_before
            rows.append({"tools": with_tools, "streams": streams, "tokens": received, "tool_call_deltas": deltas,
                         "seconds": elapsed, "tok_per_s": received / elapsed, "frontend_cpu_s": cpu})
    finally:
        for process in (frontend, engine):
            if process is not None:
                process.terminate()
                process.wait(15)
        os.unlink(script.name)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32, help="concurrent Chat streams (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per stream (default: %(default)s)")
    parser.add_argument("--chunks", type=int, default=2000, help="chunks timed per parser (default: %(default)s)")
    parser.add_argument("--output", default="bench_results/tools.json")
    args = parser.parse_args()
    tokenizer = load_tokenizer(smollm2_gguf())
    parsing = parse_times(tokenizer, args.chunks)
    print(f"{'parser':>12} | {'chunks':>7} | {'p50 us':>7} | {'p99 us':>7} | {'max us':>8}")
    for name, row in parsing.items():
        print(f"{name:>12} | {row['chunks']:>7} | {row['p50_us']:7.1f} | {row['p99_us']:7.1f} | {row['max_us']:8.1f}")
    rows = streams_side_by_side(tokenizer, args.streams, args.tokens)
    print(f"\n{'tools':>5} | {'streams':>7} | {'tokens':>8} | {'deltas':>7} | {'seconds':>7} | {'tok/s':>8} | "
          f"{'frontend CPU s':>14}")
    for row in rows:
        print(f"{'yes' if row['tools'] else 'no':>5} | {row['streams']:>7} | {row['tokens']:>8} | "
              f"{row['tool_call_deltas']:>7} | {row['seconds']:7.2f} | {row['tok_per_s']:8.0f} | "
              f"{row['frontend_cpu_s']:14.2f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "tool calling on the frontend", "parse_per_chunk": parsing,
                               "streams": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
