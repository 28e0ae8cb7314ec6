"""Triton paged attention vs SDPA, and engine decode speed vs the HBM roofline (CUDA only).

One run, one table per part, one JSON file:

1. the device's copy bandwidth: a 1 GiB device-to-device copy, bytes read + written / time;
2. attention: the Triton kernel (kernels/triton/paged_attention.py, reading K/V through
   shuffled block tables) against torch.nn.functional.scaled_dot_product_attention over
   the same K/V stored dense (enable_gqa), on decode shapes (batch 1/16/64 x context
   512/2k/8k) and prefill shapes, for SmolLM2's heads (9 query / 3 kv, dim 64) and a
   32/8/128 shape; the outputs are compared too;
3. engine decode tokens/s on the embedded SmolLM2 (LLMEngine, greedy, EOS ignored) at
   batch 1 and 64, with CUDA graphs and with enforce_eager, beside the roofline step time
   (weight bytes + KV bytes read per step) / copy bandwidth. "GPU step" is one captured
   decode graph replayed on its own: the forward pass without the engine's host work.

    python scripts/bench_kernels.py
    python scripts/bench_kernels.py --dtype float16 --skip-engine
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scripts.attention_cases import attention_cases, make_case, max_abs_diff, sdpa_attention, triton_attention  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="engine part: a Hugging Face folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16, choices=[16, 32])
    parser.add_argument("--engine-batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--skip-attention", action="store_true", help="engine part only")
    parser.add_argument("--skip-engine", action="store_true", help="bandwidth and attention parts only")
    parser.add_argument("--output", default="bench_results/kernels.json", help="where to write JSON")
    return parser.parse_args()


def bench_ms(fn) -> float:
    """Median milliseconds of fn on the GPU (triton's do_bench: warm-up, cache flush, CUDA events)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


# ---- 1. bandwidth ---------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes per second of a large device-to-device copy (each byte read once, written once)."""
    num_bytes = int(gib * 2**30)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = bench_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * num_bytes / seconds


# ---- 2. attention ---------------------------------------------------------------------------
def bench_attention(args, dtype, device, bandwidth: float) -> list[dict]:
    print(f"\n{'kind':>7} | {'heads':>9} | {'B':>3} | {'context':>7} | {'triton ms':>9} | {'SDPA ms':>8} | "
          f"{'ratio':>5} | {'triton GB/s':>11} | {'of copy bw':>10} | {'max |diff|':>10}")
    print("-" * 103)
    rows = []
    for kind, batch, context, heads in attention_cases():
        case = make_case(kind, batch, context, heads, args.block_size, dtype, device)
        triton_ms = bench_ms(partial(triton_attention, case))
        sdpa_ms = bench_ms(partial(sdpa_attention, case))
        row = {
            "kind": kind, "heads": list(heads), "batch": batch, "context": context,
            "triton_ms": triton_ms, "sdpa_ms": sdpa_ms, "ratio": triton_ms / sdpa_ms,
            "triton_kv_gb_per_s": case.kv_bytes / (triton_ms / 1e3) / 1e9,
            "max_abs_diff": max_abs_diff(case),
        }
        row["fraction_of_copy_bandwidth"] = row["triton_kv_gb_per_s"] * 1e9 / bandwidth
        rows.append(row)
        print(f"{kind:>7} | {'/'.join(map(str, heads)):>9} | {batch:>3} | {context:>7} | {triton_ms:9.4f} | "
              f"{sdpa_ms:8.4f} | {row['ratio']:5.2f} | {row['triton_kv_gb_per_s']:11.0f} | "
              f"{row['fraction_of_copy_bandwidth']:10.2f} | {row['max_abs_diff']:10.2e}", flush=True)
        del case
    return rows


# ---- 3. engine decode ------------------------------------------------------------------------
def make_engine(args, cuda_graphs: bool):
    from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine_core.offline.llm_engine import LLMEngine

    max_batch = max(args.engine_batches)
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.gen_len + 16),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=4.0),
        scheduler=SchedulerConfig(
            max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * args.prompt_len),
        ),
        device=DeviceConfig(device="cuda", enforce_eager=not cuda_graphs),
    ))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter once (a tied LM head shares the embedding's)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(engine) -> int:
    arch, runner = engine.engine_core.arch, engine.engine_core.runner
    element = torch.empty((), dtype=runner.dtype).element_size()
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * element


def bench_decode(engine, batch: int, args, bandwidth: float) -> dict:
    """Prefill `batch` prompts, then time the pure-decode steps until every request ends."""
    from engine_core.protocol import OutputKind, SamplingParams

    engine.engine_core.reset_prefix_cache()
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True,
                            output_kind=OutputKind.DELTA)
    for i in range(batch):
        prompt = torch.randint(100, vocab - 100, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(f"bench-{batch}-{i}", prompt, params)
    started = set()
    while len(started) < batch:  # prefill steps: every request gets its first token
        started.update(o.request_id for o in engine.step() if o.completions[0].token_ids)
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    steps = tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()  # sampled ids reach the host: each step ends in a sync
        steps += 1
        tokens += sum(len(c.token_ids) for o in outputs for c in o.completions)
    end.record()
    torch.cuda.synchronize()
    seconds = begin.elapsed_time(end) / 1e3

    # roofline: every weight once per step, plus each request's whole context of K and V;
    # decode step s (0-based) reads prompt_len + 1 + s positions per request
    weights = weight_bytes(engine.engine_core.model)
    per_token = kv_bytes_per_token(engine)
    mean_context = args.prompt_len + 1 + (steps - 1) / 2
    roofline_s = (weights + batch * mean_context * per_token) / bandwidth
    row = {
        "batch": batch, "decode_steps": steps, "decode_tokens": tokens, "tok_per_s": tokens / seconds,
        "step_ms": seconds / steps * 1e3, "roofline_step_ms": roofline_s * 1e3,
        "roofline_tok_per_s": batch / roofline_s, "weight_bytes": weights,
        "kv_bytes_per_step": int(batch * mean_context * per_token),
    }
    row["step_over_roofline"] = row["step_ms"] / row["roofline_step_ms"]
    graphs = engine.engine_core.runner.decode_graphs
    if graphs is not None:  # the last decode step's inputs are still in the static buffers
        from engine_core.runner.cuda_graphs import bucket_for

        last_context = args.prompt_len + steps
        replay_roofline_s = (weights + batch * last_context * per_token) / bandwidth
        row["gpu_step_ms"] = bench_ms(graphs.graphs[bucket_for(graphs.sizes, batch)].replay)
        row["gpu_step_over_roofline"] = row["gpu_step_ms"] / (replay_roofline_s * 1e3)
        engine.engine_core.reset_prefix_cache()  # replays rewrote (identical) K/V into freed blocks
    return row


def bench_engine(args, bandwidth: float) -> list[dict]:
    print(f"\n{'graphs':>6} | {'batch':>5} | {'tok/s':>8} | {'step ms':>8} | {'roofline ms':>11} | "
          f"{'step/roof':>9} | {'GPU step ms':>11} | {'GPU/roof':>8} | {'roofline tok/s':>14}")
    print("-" * 104)
    rows = []
    for cuda_graphs in (True, False):
        engine = make_engine(args, cuda_graphs)
        for batch in args.engine_batches:
            bench_decode(engine, batch, args, bandwidth)  # warm-up: compiles every launch shape it meets
            row = {"cuda_graphs": cuda_graphs, **bench_decode(engine, batch, args, bandwidth)}
            rows.append(row)
            gpu = f"{row['gpu_step_ms']:11.3f}" if "gpu_step_ms" in row else f"{'-':>11}"
            gpu_ratio = f"{row['gpu_step_over_roofline']:8.2f}" if "gpu_step_ms" in row else f"{'-':>8}"
            print(f"{'on' if cuda_graphs else 'off':>6} | {batch:>5} | {row['tok_per_s']:8.0f} | "
                  f"{row['step_ms']:8.3f} | {row['roofline_step_ms']:11.3f} | {row['step_over_roofline']:9.2f} | "
                  f"{gpu} | {gpu_ratio} | {row['roofline_tok_per_s']:14.0f}", flush=True)
        del engine
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (torch sees none): the Triton kernels are checked on CPU "
                 "by the tests in tests/kernels instead, in Triton's interpreter")
    import triton

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    print(f"{name}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write of a 1 GiB copy)")
    result = {
        "benchmark": "kernels", "device": name, "dtype": args.dtype, "block_size": args.block_size,
        "torch": torch.__version__, "triton": triton.__version__, "machine": platform.machine(),
        "copy_bandwidth_gb_per_s": bandwidth / 1e9,
    }
    if not args.skip_attention:
        result["attention"] = bench_attention(args, dtype, device, bandwidth)
    if not args.skip_engine:
        result["engine_decode"] = {
            "model": "SmolLM2-135M-Instruct (embedded GGUF)", "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "rows": bench_engine(args, bandwidth),
        }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
