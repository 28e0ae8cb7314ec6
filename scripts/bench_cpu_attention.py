"""CPU attention and decode step: the pure-torch path against the C++ kernels, on the main thread.

One run, two tables and one JSON file:

1. attention per layer, SmolLM2's shapes (9 query / 3 kv heads, dim 64, blocks of 16): the
   torch reference (kernels/reference/attention.py: gathers each request's rows with index_select,
   then matmuls) against the C++ kernel (kernels/cpu/attention.py: reads blocks in place),
   decodes at batch 1 / 32 x context 128 / 1k / 3k, plus prefill chunks over a prefix. Each
   case cycles through 30 layers' caches, as a step does, so K/V come from memory, not cache;
2. the in-process decode step of the embedded SmolLM2 (EngineCore.step, greedy) at batch 1
   and 32 after 128-token prompts, and at batch 1 after a 3,000-token prompt: "before" =
   torch attention with --enforce-eager (no fused layer ops), "after" = the defaults (C++
   attention and fused ops); with torch.profiler's top operators per step for each.

Timings are medians (attention: best of 5 passes); quote ratios, since shared machines drift.

    python scripts/bench_cpu_attention.py
    python scripts/bench_cpu_attention.py --skip-engine --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.engine_core import EngineCore  # noqa: E402
from engine_core.protocol import (
    EngineCoreRequest,  # noqa: E402
    SamplingParams,  # noqa: E402
)
from kernels import AttentionMetadata, select_backend
from kernels.cpu import extension as cpu_extension  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M
LAYERS = 30
DECODES = [(1, 128), (1, 1024), (1, 3072), (32, 128), (32, 1024), (32, 3072)]  # (batch, context)
PREFILLS = [(128, 0), (512, 512), (512, 2560)]  # (chunk tokens, cached prefix before it)
STEPS = [(1, 128), (32, 128), (1, 3000)]  # (batch, prompt tokens)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="attention table")
    parser.add_argument("--skip-engine", action="store_true", help="attention table only")
    parser.add_argument("--output", default="bench_results/cpu_attention.json", help="where to write JSON")
    return parser.parse_args()


# ---- 1. attention per layer -------------------------------------------------------------------
def make_layers(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """LAYERS (query, key_cache, value_cache) over one shared metadata; blocks in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    slots = []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        mine = [order.pop() for _ in range(blocks_per_req[b])]
        tables[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        slots += [mine[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_decodes=sum(1 for q in query_lens if q == 1),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
    )
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    layers = [(torch.randn(qsl[-1], HEADS, HEAD_DIM, generator=gen).to(dtype),
               torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
              for _ in range(LAYERS)]
    return layers, md


def time_layers(backend, layers, md, passes: int = 5) -> float:
    """Best of `passes` over all layers, per layer, in microseconds (the per-step plan included)."""
    best = float("inf")
    for _ in range(passes):
        md.scratch.clear()
        started = time.perf_counter()
        for query, key_cache, value_cache in layers:
            backend.paged_attention(query, key_cache, value_cache, md, HEAD_DIM**-0.5)
        best = min(best, time.perf_counter() - started)
    return best / len(layers) * 1e6


def bench_attention(dtype: torch.dtype) -> list[dict]:
    torch_backend, cpp_backend = select_backend("cpu", "torch"), select_backend("cpu", "cpp")
    cases = [("decode", b, ctx, [1] * b, [ctx] * b) for b, ctx in DECODES]
    cases += [("prefill", 1, chunk + prefix, [chunk], [chunk + prefix]) for chunk, prefix in PREFILLS]
    rows = []
    print(f"{'attention per layer':<20} | {'batch':>5} | {'context':>7} | {'torch us':>9} | "
          f"{'C++ us':>8} | {'speedup':>7}")
    for kind, batch, context, query_lens, seq_lens in cases:
        layers, md = make_layers(query_lens, seq_lens, dtype)
        old, new = time_layers(torch_backend, layers, md), time_layers(cpp_backend, layers, md)
        label = kind if kind == "decode" else f"prefill {query_lens[0]}"
        rows.append({"kind": kind, "batch": batch, "context": context, "query_tokens": sum(query_lens),
                     "torch_us": round(old, 1), "cpp_us": round(new, 1), "speedup": round(old / new, 2)})
        print(f"{label:<20} | {batch:>5} | {context:>7} | {old:9.1f} | {new:8.1f} | {old / new:6.2f}x", flush=True)
    return rows


# ---- 2. the engine's decode step ---------------------------------------------------------------
def decode_engine(batch: int, prompt_len: int, backend: str, enforce_eager: bool) -> EngineCore:
    """An EngineCore whose `batch` requests have finished their prompts and are decoding."""
    core = EngineCore(EngineConfig(
        model=ModelConfig(max_model_len=prompt_len + 256),
        cache=CacheConfig(kv_cache_memory_gib=0.5),
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=4096),
        device=DeviceConfig(attention_backend=backend, enforce_eager=enforce_eager),
    ))
    gen = torch.Generator().manual_seed(batch * 7919 + prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(100, core.info.vocab_size - 100, (prompt_len,), generator=gen).tolist()
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(3):  # warm-up decodes
        core.step()
    return core


def bench_step(batch: int, prompt_len: int, backend: str, enforce_eager: bool, steps: int = 15) -> dict:
    core = decode_engine(batch, prompt_len, backend, enforce_eager)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    profiled = 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            core.step()
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "attention": core.info.attention_backend, "fused_ops": not enforce_eager,
        "step_ms": round(statistics.median(times) * 1e3, 2),
        "top_ops": [{"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1e3 / profiled, 2),
                     "calls_per_step": e.count // profiled} for e in top],
    }


def bench_engine() -> list[dict]:
    rows = []
    for batch, prompt_len in STEPS:
        before = bench_step(batch, prompt_len, "torch", enforce_eager=True)
        after = bench_step(batch, prompt_len, "auto", enforce_eager=False)
        rows.append({"batch": batch, "prompt_len": prompt_len, "before": before, "after": after,
                     "speedup": round(before["step_ms"] / after["step_ms"], 2)})
        print(f"\ndecode step, batch {batch}, after a {prompt_len}-token prompt: before {before['step_ms']:.1f} ms "
              f"(torch attention, eager) -> after {after['step_ms']:.1f} ms ({after['attention']} attention, "
              f"fused ops): {rows[-1]['speedup']:.2f}x")
        for name, side in (("before", before), ("after", after)):
            ops = ", ".join(f"{o['op']} {o['ms_per_step']:.1f} ({o['calls_per_step']})" for o in side["top_ops"])
            print(f"  {name:>6} top ops, ms per step (calls): {ops}", flush=True)
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    args = parse_args()
    if not cpu_extension.load():
        sys.exit("the C++ CPU kernels did not build (no compiler? see the log): nothing to compare")
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, main thread\n")
    result = {
        "benchmark": "CPU attention and decode step", "model": "SmolLM2-135M-Instruct (GGUF)",
        "threads": torch.get_num_threads(), "machine": cpu_name(),
        "attention_dtype": args.dtype, "attention": bench_attention(getattr(torch, args.dtype)),
    }
    if not args.skip_engine:
        result["decode_step"] = bench_engine()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
