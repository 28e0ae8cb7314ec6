"""`tandem bench`: the metrics and load generators on their own, then short real runs against the
live stack (closed- and open-loop sweeps, a JSONL prompt file, side by side with its peers)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clients.bench.loadgen import closed_loop, open_loop
from clients.bench.metrics import RequestRecord, percentile, summarize
from clients.bench.prompts import BenchPrompt, jsonl_prompts, synthetic_prompts
from clients.bench.side_by_side import transformers_closed_loop
from clients.client import TandemClient
from engine_core.loader import default_model_path
from tests.clients.conftest import run_async, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- metrics, prompts, load generators --------------------------------------------------------------
def test_make_bench_weighs_each_floor_row_by_the_weights_its_kernel_runs():
    """`make bench`'s floor of the kernels used (scripts/bench_peers.py): cpu_floor's rows weighted by the
    share of the weights on each kernel; float kernels count as the model's dtype, int4 as int8 weight-only."""
    from scripts.bench_peers import floor_of_plans

    floor = {"linears_only": [{"dtype": "bfloat16", "batch": 32, "step_ms": 40.0},
                              {"dtype": "int8-dynamic-w8a8", "batch": 32, "step_ms": 20.0},
                              {"dtype": "int8-weight-only", "batch": 32, "step_ms": 80.0}]}
    kernels = {"int8_vnni": 600, "int8_dynamic": 150, "linear_bf16_packed": 200, "int4": 50}
    assert floor_of_plans(floor, "bfloat16", kernels, 32) == pytest.approx(0.75 * 20 + 0.2 * 40 + 0.05 * 80)
    assert floor_of_plans(floor, "bfloat16", {"linear_onednn": 1}, 32) == 40.0
    assert floor_of_plans(floor, "bfloat16", kernels, 1) is None  # no row at that batch
    assert floor_of_plans(None, "bfloat16", kernels, 32) is None


def test_summary_of_hand_made_records():
    a = RequestRecord(start=0.0, prompt_tokens=4, chunk_times=[0.1, 0.3, 0.4], output_tokens=3, end=0.4)
    b = RequestRecord(start=1.0, prompt_tokens=4, chunk_times=[1.3, 1.4], output_tokens=2, end=1.5)
    failed = RequestRecord(start=2.0, error="RESOURCE_EXHAUSTED")
    summary = summarize([a, b, failed], wall_s=2.0)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, {"RESOURCE_EXHAUSTED": 1})
    assert summary["output_token_throughput"] == pytest.approx(2.5) and summary["request_throughput"] == 1.0
    assert summary["ttft"]["p50_ms"] == pytest.approx(200) and summary["ttft"]["mean_ms"] == pytest.approx(200)
    assert summary["itl"] == pytest.approx({"mean_ms": 400 / 3, "p50_ms": 100, "p90_ms": 180, "p99_ms": 198})
    assert summary["tpot"]["p50_ms"] == pytest.approx((0.15 + 0.2) / 2 * 1000)
    assert summary["e2e"]["p99_ms"] == pytest.approx(499)  # 400 + 0.99 * (500 - 400)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    empty = summarize([failed], wall_s=1.0)
    assert empty["ttft"]["p50_ms"] is None and json.dumps(empty)


def test_synthetic_prompts_are_seeded_and_token_exact():
    vocabulary = {}

    def tokenize(text):  # one token per character, a stand-in tokenizer
        return [vocabulary.setdefault(ch, len(vocabulary)) for ch in text]

    first = synthetic_prompts(5, 12, 3, seed=1, tokenize=tokenize)
    assert first == synthetic_prompts(5, 12, 3, seed=1, tokenize=tokenize)
    assert first != synthetic_prompts(5, 12, 3, seed=2, tokenize=tokenize)
    assert all(p.num_tokens == 12 and p.max_tokens == 3 for p in first)
    assert len({p.token_ids for p in first}) == 5
    words = synthetic_prompts(2, 7, 3, seed=1)
    assert all(len(p.text.split()) == 7 and p.token_ids is None for p in words)


def test_jsonl_prompts_and_their_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"token_ids": [1, 2]}\n')
    assert jsonl_prompts(good, 9) == [BenchPrompt("hi", None, 3), BenchPrompt(None, (1, 2), 9)]
    for line, message in (('{"prompt": "a", "token_ids": [1]}', "exactly one"), ("nope", "not JSON"),
                          ('{"prompt": "a", "max_tokens": 0}', "max_tokens")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            jsonl_prompts(bad, 4)


class CountingBackend:
    """Sleeps a little per token and counts how many requests are in flight at once."""

    name = "counting"

    def __init__(self):
        self.in_flight = self.most_in_flight = 0

    async def stream(self, prompt):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for _ in range(prompt.max_tokens):
                await asyncio.sleep(0.002)
                yield 1, 5
        finally:
            self.in_flight -= 1


def test_closed_loop_keeps_n_in_flight_and_open_loop_does_not_wait():
    prompts = [BenchPrompt("x", None, 3)] * 9
    backend = CountingBackend()
    records, _ = run_async(closed_loop(backend, prompts, 3))
    assert backend.most_in_flight == 3 and all(r.ok and r.output_tokens == 3 for r in records)
    backend = CountingBackend()
    records, _ = run_async(open_loop(backend, prompts, rate=10_000, seed=0))
    assert backend.most_in_flight > 3 and len(records) == 9 and all(r.ok for r in records)


# ---- real runs against the live stack ------------------------------------------------------------------
def bench(address: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--address", address, "--output", str(out), "--no-progress", *flags, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "TTFT p50" in result.stdout
    return json.loads(out.read_text())


def test_closed_loop_sweep_writes_json_and_a_png(live_stack, tmp_path):
    result = bench(live_stack.frontend_address, tmp_path, "--concurrency", "1", "3", "--num-requests", "3",
                   "--input-len", "12", "--output-len", "4")
    assert [p["concurrency"] for p in result["sweep"]] == [1, 3]
    for point in result["sweep"]:
        assert (point["completed"], point["errors"], point["output_tokens"]) == (3, {}, 12)
        assert point["prompt_tokens"] == 36  # exactly --input-len tokens each, via the server's Tokenize
        assert point["ttft"]["p50_ms"] > 0 and point["tpot"]["p50_ms"] > 0 and point["e2e"]["p99_ms"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_open_loop_sweep_from_a_jsonl_file(live_stack, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Tell me a story", "max_tokens": 3}\n{"token_ids": [5, 6, 7, 8]}\n')
    result = bench(live_stack.frontend_address, tmp_path, "--rate", "20", "40", "--num-requests", "4",
                   "--prompts-file", str(prompts), "--output-len", "2", "--plot", str(tmp_path / "rate.png"))
    assert result["mode"] == "open loop" and [p["rate"] for p in result["sweep"]] == [20.0, 40.0]
    assert all((p["completed"], p["output_tokens"]) == (4, 2 * 3 + 2 * 2) for p in result["sweep"])
    assert (tmp_path / "rate.png").read_bytes()[:8] == PNG_MAGIC


def test_errors_are_counted_by_code(live_stack, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"token_ids": [5, 6]}\n{"token_ids": [999999]}\n')  # an id outside the vocabulary
    result = bench(live_stack.frontend_address, tmp_path, "--concurrency", "2", "--num-requests", "4",
                   "--prompts-file", str(prompts), "--output-len", "2")
    point = result["sweep"][0]
    assert (point["completed"], point["failed"], point["errors"]) == (2, 2, {"INVALID_ARGUMENT": 2})


class FakeLlamaServer(BaseHTTPRequestHandler):
    """llama-server's OpenAI-compatible streaming /v1/completions: one SSE event per token."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            event = {"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def llama_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLlamaServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_side_by_side_runs_the_peers_on_the_same_prompts(live_stack, tmp_path, llama_server):
    result = bench(live_stack.frontend_address, tmp_path, "--side-by-side", "--concurrency", "2",
                   "--num-requests", "2", "--input-len", "8", "--output-len", "3", "--dtype", "float32",
                   "--llama-server", llama_server, "--no-transformers",  # transformers: the test below
                   "--tokenizer", str(default_model_path()))  # the tiny model has none of its own
    assert set(result["series"]) == {"tandem-grpc", "in-process", "llama.cpp-server"}
    for name, points in result["series"].items():
        assert (points[0]["completed"], points[0]["output_tokens"]) == (2, 6), name
    ratios = result["ratios"][0]
    assert set(ratios) == {"concurrency", "vs in-process", "vs llama.cpp-server"}
    assert ratios["vs in-process"]["output_token_throughput"] > 0
    assert result["skipped"] == {"transformers": "skipped (--no-transformers)"}


def test_transformers_peer_runs_static_batches(live_stack):
    import torch

    from clients.bench.transformers_peer import load_transformers

    with TandemClient(live_stack.frontend_address, timeout=60) as client:
        model_path = client.model_info().model_path
    prompts = [BenchPrompt(None, (5, 6, 7), 3), BenchPrompt(None, (8, 9), 3), BenchPrompt(None, (10,), 3)]
    ticks = []
    records, wall = transformers_closed_loop(load_transformers(model_path, torch.float32), prompts, 2,
                                             lambda: ticks.append(1))
    summary = summarize(records, wall)
    assert (summary["completed"], summary["output_tokens"], len(ticks)) == (3, 9, 3)
    assert summary["ttft"]["p50_ms"] is None and summary["e2e"]["p50_ms"] > 0
