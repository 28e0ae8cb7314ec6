"""Speculative decoding (n-gram, or a draft model), on and off side by side in one process, on the embedded
SmolLM2 (issue 52).

One engine with speculation configured serves both modes: "off" sends every request with
sampling_params.speculative false, so both run the same kernels, plans and KV cache. Rounds alternate the modes.
Each round runs the workload's chat prompts at once (greedy, up to --max-tokens, ending at EOS as a user's would),
with the prefix cache reset, and counts:

- tok/s: generated tokens over the round's wall time (prefill included);
- tokens per target forward: generated tokens over the (request, step) pairs that emitted any (one stream: the
  steps that decoded); without speculation it is 1;
- acceptance: draft tokens accepted over draft tokens verified, and the mean acceptance length
  (1 + accepted / verifications), from the engine's own counters;
- same text: how many completions are token for token those of the other mode (greedy output can still differ on a
  near-tie, as it does between batch sizes: docs/architecture.md, "Greedy output depends on the batch").

Workloads: "copy" asks for output that copies its prompt (edit this code, quote this passage, reformat a list,
correct a text), "fresh" for new text (a story, an explanation); several streams cycle through both.

    python scripts/bench_spec_decode.py                                  # 1 stream copy and fresh, 32 mixed
    python scripts/bench_spec_decode.py --streams 1 2 4 8 16 32 --max-batch 64   # where speculation stops paying
    python scripts/bench_spec_decode.py --streams 1 --rounds 1 --max-tokens 16   # a quick check that it runs
    python scripts/bench_spec_decode.py --model BIG --draft-model SMALL          # a draft model instead of n-grams

With --max-batch above the stream count every step speculates (the batch rule off): the ratio at each stream count
says where --speculative-max-batch (engine_core/config.py's DEFAULT_SPECULATIVE_MAX_BATCH) belongs on a machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine_core.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_core.offline.llm_engine import LLMEngine  # noqa: E402
from engine_core.protocol import OutputKind, SamplingParams  # noqa: E402
from engine_core.text.chat_template import render_chat  # noqa: E402

CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] != "cancelled":
            total += order["amount"]
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}
'''
PASSAGE = ("The Millbrook bridge was designed by the engineer Clara Vance in 1921. Work on its stone piers began in "
           "the spring of 1923, and the river flooded twice before the arches were closed. The bridge opened to "
           "traffic on the fourth of October 1926, with a parade of farm carts and a brass band. It was widened in "
           "1958 and restored again in 2004, when its original lamps were found in a barn and put back.")
ITEMS = "apples, bread, olive oil, two lemons, rice, black pepper, yogurt, fresh basil, coffee beans, dish soap"
TYPOS = ("Yesterday we went to the libary to borow some books about astronmy. The librarian recomended a guide to "
         "the night sky and a biografy of a famous scientist. We will return them nex week.")

WORKLOADS = {
    "copy": [
        f"Here is a Python function:\n\n{CODE}\nRename the variable `total` to `running_sum` everywhere and write out "
        "the whole function.",
        f"Read this passage:\n\n{PASSAGE}\n\nQuote, word for word, the sentence that says when the bridge opened, "
        "then the sentence about its restoration.",
        f"Write this shopping list one item per line, each line starting with '- ', in the same order: {ITEMS}.",
        f"Correct the spelling mistakes in this text and give back the whole corrected text:\n\n{TYPOS}",
    ],
    "fresh": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how photosynthesis works to a ten-year-old.",
        "Give me five ideas for a child's birthday party, with a sentence on each.",
        "What are the benefits of regular exercise? Answer in a paragraph.",
    ],
}
MODES = ("off", "on")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32],
                        help="concurrent requests; 1 runs the copy and fresh workloads apart, more cycle both")
    parser.add_argument("--k", type=int, default=SpeculativeConfig.num_speculative_tokens,
                        help="--num-speculative-tokens")
    parser.add_argument("--prompt-lookup-min", type=int, default=SpeculativeConfig.prompt_lookup_min)
    parser.add_argument("--prompt-lookup-max", type=int, default=SpeculativeConfig.prompt_lookup_max)
    parser.add_argument("--max-batch", type=int, default=None,
                        help="--speculative-max-batch (default: the device's; above the streams: always speculate)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--model", default=None, help="a HF folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--draft-model", default=None,
                        help="speculate with this draft model (same tokenizer) instead of prompt lookup")
    parser.add_argument("--output", default="bench_results/spec_decode.json", help="where to write JSON")
    return parser.parse_args()


def chat_prompts(engine: LLMEngine, texts: list[str]) -> list[list[int]]:
    tokenizer = engine.get_tokenizer()
    rendered = [render_chat(tokenizer.chat_template, [{"role": "user", "content": text}],
                            bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token) for text in texts]
    return [tokenizer.encode(text, add_special_tokens=False) for text in rendered]


def run_round(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, speculative: bool) -> dict:
    """All prompts at once; tokens, time, forwards and the engine's speculation counters."""
    core = engine.engine_core
    core.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative=speculative,
                            output_kind=OutputKind.DELTA)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{index}", prompt, params)
    tokens: dict[str, list[int]] = {f"bench-{index}": [] for index in range(len(prompts))}
    forwards = steps = drafts = draft_tokens = accepted = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        stats = core.scheduler.spec_decode_stats
        drafts, draft_tokens, accepted = (drafts + stats.num_drafts, draft_tokens + stats.num_draft_tokens,
                                          accepted + stats.num_accepted_tokens)
        for output in outputs:
            new = output.completions[0].token_ids
            forwards += bool(new)
            tokens[output.request_id] += new
    seconds = time.perf_counter() - started
    generated = sum(len(t) for t in tokens.values())
    return {"seconds": seconds, "generated_tokens": generated, "tok_per_s": generated / seconds, "steps": steps,
            "tokens_per_forward": generated / max(forwards, 1), "drafts": drafts, "draft_tokens": draft_tokens,
            "accepted_tokens": accepted, "tokens": list(tokens.values())}


def summarize(rounds: dict[str, list[dict]]) -> dict:
    row = {}
    for mode in MODES:
        runs = rounds[mode]
        seconds, generated = sum(r["seconds"] for r in runs), sum(r["generated_tokens"] for r in runs)
        drafts, draft_tokens = sum(r["drafts"] for r in runs), sum(r["draft_tokens"] for r in runs)
        accepted = sum(r["accepted_tokens"] for r in runs)
        row[mode] = {"tok_per_s": generated / seconds, "tok_per_s_rounds": [round(r["tok_per_s"], 1) for r in runs],
                     "tokens_per_forward": sum(r["tokens_per_forward"] for r in runs) / len(runs),
                     "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                     "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    row["speedup"] = row["on"]["tok_per_s"] / row["off"]["tok_per_s"]
    pairs = [(a, b) for off, on in zip(rounds["off"], rounds["on"]) for a, b in zip(off["tokens"], on["tokens"])]
    row["same_text"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return row


def main() -> None:
    args = parse_args()
    spec = SpeculativeConfig(method="draft" if args.draft_model else "ngram", num_speculative_tokens=args.k,
                             prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                             draft_model=args.draft_model, max_batch=args.max_batch)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=1024),
        cache=CacheConfig(kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_seqs=max(args.streams)),
        speculative=spec,
    ))
    runner_spec = engine.engine_core.runner.spec
    print(f"{engine.info.model_name} {engine.info.dtype}, {torch.get_num_threads()} threads, {spec.method}, "
          f"k={args.k}, speculating while at most {runner_spec.max_batch} requests run", flush=True)
    encoded = {name: chat_prompts(engine, texts) for name, texts in WORKLOADS.items()}
    run_round(engine, encoded["fresh"][:2], 4, True)  # warm-up: plans, first-use compilation
    cases = []
    for streams in args.streams:
        if streams == 1:
            cases += [(1, name, prompts) for name, prompts in encoded.items()]
        else:
            mixed = [p for pair in zip(encoded["copy"], encoded["fresh"]) for p in pair]
            cases.append((streams, "mixed", [mixed[i % len(mixed)] for i in range(streams)]))
    rows = []
    for streams, workload, prompts in cases:
        rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            if streams == 1:  # one stream: each prompt alone, one after the other
                for mode in MODES:
                    runs = [run_round(engine, [p], args.max_tokens, mode == "on") for p in prompts]
                    rounds[mode].append(_merge(runs))
            else:
                for mode in MODES:
                    rounds[mode].append(run_round(engine, prompts, args.max_tokens, mode == "on"))
        row = {"streams": streams, "workload": workload, **summarize(rounds)}
        rows.append(row)
        on, off = row["on"], row["off"]
        acceptance = "-" if on["acceptance_rate"] is None else f"{on['acceptance_rate']:.2f}"
        length = "-" if on["mean_acceptance_length"] is None else f"{on['mean_acceptance_length']:.2f}"
        print(f"{streams:>3} stream(s) {workload:<6} off {off['tok_per_s']:7.1f} tok/s | on {on['tok_per_s']:7.1f} "
              f"tok/s, {on['tokens_per_forward']:.2f} tokens/forward, acceptance {acceptance}, "
              f"mean length {length} | {row['speedup']:.2f}x, same text {row['same_text']}", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = platform.processor() or platform.machine()
    out.write_text(json.dumps({
        "benchmark": f"speculative decoding ({spec.method}), on vs off", "model": engine.info.model_name,
        "draft_model": args.draft_model,
        "dtype": engine.info.dtype, "k": args.k, "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
        "max_batch": runner_spec.max_batch, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "machine": machine, "rows": rows}, indent=2))
    print(f"wrote {out}")


def _merge(runs: list[dict]) -> dict:
    """Prompts run one after another as one round: their sums (tokens per forward over all their forwards)."""
    total = {key: sum(r[key] for r in runs) for key in ("seconds", "generated_tokens", "steps", "drafts",
                                                         "draft_tokens", "accepted_tokens")}
    forwards = sum(r["generated_tokens"] / r["tokens_per_forward"] for r in runs)
    return {**total, "tok_per_s": total["generated_tokens"] / total["seconds"],
            "tokens_per_forward": total["generated_tokens"] / max(forwards, 1),
            "tokens": [t for r in runs for t in r["tokens"]]}


if __name__ == "__main__":
    main()
