"""Quality against the fp32 model (`make bench-quality`): perplexity, mean |log-prob change|, top-1 agreement
and KL divergence of Tandem's CPU paths and of llama.cpp on the same GGUF, teacher-forced over real text.

The method is llama.cpp's `llama-perplexity`: the text's first 8 x 512 token ids cut into chunks of 512, each
chunk run from an empty cache, the predictions of its second half scored (positions 256..510 predicting
tokens 257..511: 2,040 in all). The same token ids go to every system. The reference is the same GGUF's
weights dequantized and run in fp32 by transformers; every figure compares a system's log-probs with it.

  prefill  each chunk as one prompt with prompt log-probs: the prefill-bucket kernels (steps of 2,048 rows,
           four chunks, as llama-perplexity batches them; the LM head on its 128-row bucket's kernel)
  decode   each chunk's first token as a prompt, the other 511 fed one token per step as if sampled
           (teacher forcing), the 8 chunks as 8 concurrent sequences: every step, the KV cache of the
           context included, runs the 8-row decode bucket's kernels
  llama.cpp  `llama-perplexity --kl-divergence` over a base file holding our token ids and the fp32
           reference's log-probs (its own format), so llama.cpp scores the same ids against the same reference

The text: chapters of the Python Language Reference as CPython ships them in `pydoc_data/topics.py`
(docs/quality.md says why). Tandem runs in process (LLMEngine); a tap on its model runner reads the logits it
computes (and, in decode, replaces the sampled token by the text's), without changing how they are computed.

    python scripts/bench_quality.py                                  # the main table (+ llama.cpp when it builds)
    python scripts/bench_quality.py --linear-kernels 'down_proj=int8_dynamic'   # + a row for a forced plan
    python scripts/bench_quality.py --roles --skip-main              # each kernel forced on each layer role
    python scripts/bench_quality.py --skip-main --no-llama --kv-cache-dtype int8   # one KV dtype and its baseline

Every row with an 8-bit KV cache (--kv-cache-dtype, and the standard rows' int8 ones) is also compared with the
same options over the model's own cache dtype: the perplexity change between the two and how often their top
tokens agree, prediction by prediction (issue 53's bars: within 1 %, at least 0.98).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from clients.bench.transformers_peer import load_transformers  # noqa: E402
from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.loader.registry import default_model_path  # noqa: E402
from engine_core.offline.llm_engine import LLMEngine  # noqa: E402
from engine_core.protocol import SamplingParams  # noqa: E402

CHUNK = 512  # llama-perplexity's default context
CHUNKS = 8
FIRST = CHUNK // 2  # predictions from this position on are scored
SCORED = CHUNK - 1 - FIRST  # per chunk: positions FIRST..CHUNK-2 predict tokens FIRST+1..CHUNK-1
# Python Language Reference chapters in CPython's pydoc_data: 3.1 "Objects, values and types",
# 4 "Execution model", 7.11 "The import statement"; ~5,300 SmolLM2 tokens, the first 4,096 used
TOPICS = ("objects", "execmodel", "import")
LLAMA_SCRIPT = ROOT / "scripts" / "llama_perplexity.sh"
# the layer roles of the per-role matrix: the model's attribute names
ROLES = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj", "lm_head": "lm_head"}
ROLE_BASE = "*=linear"  # the other roles in the matrix: bf16 F.linear, the float path's own rounding only


# ---- the text and the reference --------------------------------------------------------------------------
def text_token_ids(model_path: Path) -> tuple[list[list[int]], str]:
    """CHUNKS chunks of CHUNK token ids of the text (the GGUF's tokenizer, no BOS: SmolLM2's GGUF adds none,
    so llama-perplexity puts none either), and the text's sha256."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    text = "\n\n".join(topics[name] for name in TOPICS)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < CHUNK * CHUNKS:
        raise SystemExit(f"the text has {len(ids)} tokens, {CHUNK * CHUNKS} needed")
    return [ids[i * CHUNK:(i + 1) * CHUNK] for i in range(CHUNKS)], hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.inference_mode()
def reference_logprobs(model_path: Path, chunks: list[list[int]]) -> torch.Tensor:
    """[CHUNKS, SCORED, vocab] fp32 log-probs of the scored predictions, by transformers in fp32."""
    model = load_transformers(model_path, torch.float32)
    rows = []
    for chunk in chunks:
        logits = model(torch.tensor([chunk])).logits[0, FIRST:CHUNK - 1].float()
        rows.append(torch.log_softmax(logits, dim=-1))
    return torch.stack(rows)


# ---- scoring ------------------------------------------------------------------------------------------------
@dataclass
class Scores:
    """One system's scored predictions against the reference, by (chunk, predicted position)."""

    reference: torch.Tensor
    chunks: list[list[int]]
    target: dict = field(default_factory=dict)  # log-prob of the text's token
    delta: dict = field(default_factory=dict)  # |its change from the reference's|
    same_top: dict = field(default_factory=dict)  # the argmax is the reference's
    kl: dict = field(default_factory=dict)  # KL(reference || system)
    top: dict = field(default_factory=dict)  # the system's argmax

    def add(self, chunk: int, first_position: int, logits: torch.Tensor) -> None:
        """Row i of `logits` predicts the chunk's token at first_position + i; rows outside the scored
        predictions are ignored."""
        for i, position in enumerate(range(first_position, first_position + logits.shape[0])):
            if not FIRST + 1 <= position <= CHUNK - 1:
                continue
            lp = torch.log_softmax(logits[i].float(), dim=-1)
            ref = self.reference[chunk, position - FIRST - 1]
            token = self.chunks[chunk][position]
            key = (chunk, position)
            self.target[key] = lp[token].item()
            self.delta[key] = abs(lp[token].item() - ref[token].item())
            self.same_top[key] = bool(lp.argmax() == ref.argmax())
            self.top[key] = int(lp.argmax())
            self.kl[key] = torch.sum(ref.exp() * (ref - lp)).item()

    def summary(self) -> dict:
        expected = CHUNKS * SCORED
        if len(self.target) != expected:
            raise RuntimeError(f"scored {len(self.target)} predictions, expected {expected}")
        nll = -sum(self.target.values()) / expected
        return {"perplexity": float(np.exp(nll)), "mean_abs_logprob_change": sum(self.delta.values()) / expected,
                "top1_agreement": sum(self.same_top.values()) / expected,
                "kl_divergence": sum(self.kl.values()) / expected, "scored": expected}


def reference_summary(reference: torch.Tensor, chunks: list[list[int]]) -> dict:
    targets = torch.tensor([chunk[FIRST + 1:] for chunk in chunks])  # [CHUNKS, SCORED]
    nll = -reference.gather(-1, targets[..., None]).mean().item()
    return {"perplexity": float(np.exp(nll)), "mean_abs_logprob_change": 0.0, "top1_agreement": 1.0,
            "kl_divergence": 0.0, "scored": targets.numel()}


# ---- Tandem ---------------------------------------------------------------------------------------------------
class LogitTap:
    """Reads the logits Tandem's model runner computes, through instance attributes over four of its methods
    (their results unchanged): the prompt log-prob spans (prefill) and the sampled rows (decode), where it
    also replaces the sampled token by the text's next one (teacher forcing through the decode path).
    `score` says where the next requests' logits go."""

    def __init__(self, engine: LLMEngine):
        runner = engine.engine_core.runner
        self.scores: Scores | None = None
        self.chunk_of: dict[str, int] = {}  # request id -> its chunk
        self.spans: list | None = None  # the prompt log-prob spans of the step, while they are computed
        self.requests: list = []  # the sampled requests of the step, row by row
        prompt_logprobs, sample_rows = runner._prompt_logprobs, runner._sample
        compute_logits, sample = runner.model.compute_logits, runner.sampler.sample

        def tapped_prompt_logprobs(hidden, batch, output):
            self.spans = list(batch.prompt_logprob_spans)
            try:
                prompt_logprobs(hidden, batch, output)
            finally:
                self.spans = None

        def tapped_compute_logits(rows):
            logits = compute_logits(rows)
            if self.spans:  # called once per span, in order (ModelRunner._prompt_logprobs)
                request, _, position_start, _ = self.spans.pop(0)
                self.scores.add(self.chunk_of[request.request_id], position_start + 1, logits)
            return logits

        def tapped_sample_rows(hidden, step, metadata, masks):
            self.requests = step.requests
            return sample_rows(hidden, step, metadata, masks)

        def tapped_sample(logits, metadata):
            sampled, logprobs = sample(logits, metadata)
            for row, request in enumerate(self.requests):
                chunk, position = self.chunk_of[request.request_id], request.num_tokens  # the token predicted
                self.scores.add(chunk, position, logits[row:row + 1])
                if position < CHUNK:
                    sampled[row] = self.scores.chunks[chunk][position]
            return sampled, logprobs

        runner._prompt_logprobs, runner._sample = tapped_prompt_logprobs, tapped_sample_rows
        runner.model.compute_logits, runner.sampler.sample = tapped_compute_logits, tapped_sample

    def score(self, scores: Scores, chunk_of: dict[str, int]) -> None:
        self.scores, self.chunk_of = scores, chunk_of


def run_requests(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def plan_of(engine: LLMEngine) -> dict[str, dict[str, str]]:
    """The kernel each role runs at the prefill and decode steps measured here (the first layer's; the LM
    head's largest bucket is 128 rows) and the dtype."""
    from kernels.cpu.linear import CpuLinear

    model = engine.engine_core.model
    named = {name.rpartition(".")[2]: m for name, m in model.named_modules() if isinstance(m, CpuLinear)}
    plan = {role: {"prefill": named[attr].kernel_for(CHUNK), "decode": named[attr].kernel_for(CHUNKS)}
            for role, attr in ROLES.items() if attr in named}
    layers = model.model.decode_layers
    plan["one_op_layers"] = {"decode": f"up to {layers.max_rows} rows" if layers is not None else "not used"}
    return plan


def measure_tandem(chunks: list[list[int]], reference: torch.Tensor, dtype: str = "auto",
                   quantization: str = "auto", linear_kernels: str | None = None, model: str | None = None,
                   device: DeviceConfig | None = None, kv_cache_dtype: str = "auto") -> dict:
    """Load an engine with these options (`model` None: the embedded SmolLM2) and score its prefill and
    decode paths (see the module's doc). "argmax" holds each mode's top tokens, in scoring order."""
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, quantization=quantization, linear_kernels=linear_kernels,
                          max_model_len=CHUNK + 16),
        cache=CacheConfig(enable_prefix_caching=False, kv_cache_memory_gib=0.5, kv_cache_dtype=kv_cache_dtype),
        # prefill: four 512-token chunks a step; decode: the 8 one-token prompts in one step, then 8 rows a step
        scheduler=SchedulerConfig(max_num_batched_tokens=4 * CHUNK, max_num_seqs=CHUNKS),
        device=device or DeviceConfig(),
    ))
    result: dict = {"dtype": engine.info.dtype, "kv_cache_dtype": engine.info.kv_cache_dtype, "plan": plan_of(engine),
                    "argmax": {}}
    tap = LogitTap(engine)
    for mode in ("prefill", "decode"):
        scores = Scores(reference, chunks)
        ids = {f"{mode}-{i}": i for i in range(CHUNKS)}
        tap.score(scores, ids)
        if mode == "prefill":
            run_requests(engine, {rid: chunks[i] for rid, i in ids.items()},
                         SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
        else:
            run_requests(engine, {rid: chunks[i][:1] for rid, i in ids.items()},
                         SamplingParams(temperature=0.0, max_tokens=CHUNK - 1, ignore_eos=True))
        result[mode] = scores.summary()
        result["argmax"][mode] = [scores.top[key] for key in sorted(scores.top)]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


# ---- llama.cpp -----------------------------------------------------------------------------------------------
def write_llama_base(path: Path, chunks: list[list[int]], reference: torch.Tensor) -> None:
    """The file `llama-perplexity --kl-divergence-base` writes (tools/perplexity/perplexity.cpp): "_logits_",
    n_ctx, n_vocab, n_chunk, the token ids, then per chunk and scored position the log-probs as uint16 over
    [max - 16, max] with a float scale and minimum in front; here holding the fp32 reference's."""
    vocab = reference.shape[-1]
    with path.open("wb") as out:
        out.write(b"_logits_")
        out.write(np.array([CHUNK], dtype=np.uint32).tobytes())
        out.write(np.array([vocab, len(chunks)], dtype=np.int32).tobytes())
        out.write(np.array(chunks, dtype=np.int32).tobytes())
        for rows in reference.numpy():  # [SCORED, vocab] per chunk
            top = rows.max(axis=1, keepdims=True)
            low = np.maximum(rows.min(axis=1, keepdims=True), top - 16)
            scale = (top - low) / 65535
            codes = np.where(rows > low, np.rint((rows - low) / np.where(scale > 0, scale, 1)), 0).astype(np.uint16)
            header = np.concatenate([scale, low], axis=1).astype(np.float32).view(np.uint16)  # 2 floats = 4 uint16
            padding = np.zeros((rows.shape[0], 2 * ((vocab + 1) // 2) - vocab), dtype=np.uint16)
            out.write(np.concatenate([header, codes, padding], axis=1).tobytes())


def measure_llama(model_path: Path, chunks: list[list[int]], reference: torch.Tensor) -> dict:
    """llama-perplexity in KL-divergence mode on our ids and reference (`write_llama_base`); {"skipped": why}
    where it cannot be built or run."""
    try:
        built = subprocess.run([str(LLAMA_SCRIPT), "build"], capture_output=True, text=True, timeout=3600,
                               env={**os.environ, "PYTHON": sys.executable})
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"skipped": f"{LLAMA_SCRIPT.name} build: {error}"}
    if built.returncode != 0:
        return {"skipped": f"{LLAMA_SCRIPT.name} build failed: " + (built.stderr.strip().splitlines() or ["?"])[-1]}
    binary = built.stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "reference.kld"
        write_llama_base(base, chunks, reference)
        threads = str(os.cpu_count() or 1)
        run = subprocess.run([binary, "-m", str(model_path), "--kl-divergence-base", str(base), "--kl-divergence",
                              "-c", str(CHUNK), "-t", threads, "-tb", threads], capture_output=True, text=True)
    log = run.stdout + run.stderr
    found = {key: re.search(pattern, log) for key, pattern in {
        "perplexity": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "reference_perplexity": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
        "kl_divergence": r"Mean\s+KLD:\s*([\d.]+)", "top1_agreement": r"Same top p:\s*([\d.]+)"}.items()}
    if run.returncode != 0 or not all(found.values()):
        return {"skipped": f"llama-perplexity exited {run.returncode}: " + (log.strip().splitlines() or ["?"])[-1]}
    result = {key: float(match.group(1)) for key, match in found.items()}
    result["top1_agreement"] /= 100
    result["scored"] = CHUNKS * SCORED
    return {"binary": binary, "prefill": result}


# ---- report ------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cells(row: dict, mode: str, reference_ppl: float) -> str:
    scores = row.get(mode)
    if scores is None:
        return " | ".join(["-"] * 5)
    change = 100 * (scores["perplexity"] / reference_ppl - 1)
    delta = scores.get("mean_abs_logprob_change")
    return (f"{scores['perplexity']:.2f} | {change:+.2f} % | {'-' if delta is None else f'{delta:.4f}'} | "
            f"{scores['top1_agreement']:.3f} | {scores['kl_divergence']:.4f}")


def print_table(rows: list[dict], reference_ppl: float) -> None:
    print("\n| system | prefill: perplexity | vs fp32 | mean abs dlogp | top-1 | KL | decode: perplexity | vs fp32 "
          "| mean abs dlogp | top-1 | KL |")
    print("|---" * 11 + "|")
    for row in rows:
        if "skipped" in row:
            print(f"| {row['name']} | skipped: {row['skipped']} |" + " |" * 9)
            continue
        print(f"| {row['name']} | {cells(row, 'prefill', reference_ppl)} | {cells(row, 'decode', reference_ppl)} |")


def compare_kv_dtypes(rows: list[dict], tops: dict[str, dict[str, list[int]]]) -> list[dict]:
    """Each row with a KV cache dtype of its own against the row of the same other options over the model's cache
    dtype (its baseline): the perplexity change and the top-1 agreement between the two (`tops`: each row's top
    tokens per mode, by name), per mode."""
    def others(options: dict) -> dict:
        return {key: value for key, value in options.items() if key != "kv_cache_dtype"}

    comparisons = []
    for row in rows:
        options = row.get("options", {})
        if options.get("kv_cache_dtype", "auto") == "auto" or row["name"] not in tops:
            continue
        base = next((r for r in rows if r["name"] in tops and r.get("options", {}).get("kv_cache_dtype", "auto") ==
                     "auto" and others(r.get("options", {})) == others(options)), None)
        if base is None:
            continue
        entry = {"name": row["name"], "baseline": base["name"], "kv_cache_dtype": row["kv_cache_dtype"],
                 "baseline_kv_cache_dtype": base["kv_cache_dtype"]}
        for mode in ("prefill", "decode"):
            ours, theirs = tops[row["name"]][mode], tops[base["name"]][mode]
            entry[mode] = {"perplexity_change": row[mode]["perplexity"] / base[mode]["perplexity"] - 1,
                           "top1_agreement": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
                           "predictions": len(ours)}
        comparisons.append(entry)
    return comparisons


def print_kv_dtypes(comparisons: list[dict]) -> None:
    if not comparisons:
        return
    print("\n| KV cache against the model's own | prefill: perplexity change | top-1 agreement | "
          "decode: perplexity change | top-1 agreement |")
    print("|---" * 5 + "|")
    for entry in comparisons:
        cells = " | ".join(f"{entry[mode]['perplexity_change']:+.2%} | {entry[mode]['top1_agreement']:.3f}"
                           for mode in ("prefill", "decode"))
        print(f"| {entry['kv_cache_dtype']} vs {entry['baseline_kv_cache_dtype']} ({entry['baseline']}) | {cells} |")


def print_roles(matrix: dict, reference_ppl: float) -> None:
    """Per role and kernel: the perplexity change against fp32 and the top-1 agreement, prefill / decode."""
    def cell(row: dict) -> str:
        return " / ".join(f"{100 * (row[mode]['perplexity'] / reference_ppl - 1):+.2f} % "
                          f"({row[mode]['top1_agreement']:.3f})" for mode in ("prefill", "decode"))

    roles = [role for role in matrix if role != "base"]
    kernels = sorted({kernel for role in roles for kernel in matrix[role]})
    print(f"\nperplexity vs fp32 (top-1 agreement), prefill / decode, one role forced, the rest {ROLE_BASE}: "
          f"{cell(matrix['base'][ROLE_BASE])}")
    print("| kernel | " + " | ".join(roles) + " |")
    print("|---" * (len(roles) + 1) + "|")
    for kernel in kernels:
        print(f"| {kernel} | " + " | ".join(cell(matrix[role][kernel]) if kernel in matrix[role] else "-"
                                            for role in roles) + " |")


# Left out of the matrix unless --roles-kernels names them: the float kernels that multiply the base's bf16 products in
# another order only (the `--quantization none` row measures them), and torch's W8A8 where int8_vnni, the
# same arithmetic (per-token int8 activations x per-channel int8 weights, int32 sums), runs
SAME_AS = {"linear_colmajor": "linear", "linear_onednn": "linear", "int8_dynamic": "int8_vnni"}


def role_matrix(chunks, reference, dtype: str, kernels: list[str] | None, out: Path) -> dict:
    """For each role and each kernel that can hold its weight (`kernels`: only these; None: all but SAME_AS's):
    the model with that role on that kernel, the others on ROLE_BASE; written to `out` after each cell (a long
    run keeps what it measured)."""
    from kernels.cpu.linear import KERNELS, kernel_fits

    engine = LLMEngine(EngineConfig(model=ModelConfig(dtype=dtype, linear_kernels=ROLE_BASE, max_model_len=64)))
    named = {name.rpartition(".")[2]: m for name, m in engine.engine_core.model.named_modules()
             if hasattr(m, "kernel_for")}
    weights = {role: named[attr].state("linear")[0] for role, attr in ROLES.items()}
    del engine, named
    fits = {role: [k for k in KERNELS if kernel_fits(k, weight)] for role, weight in weights.items()}
    matrix: dict[str, dict] = {"base": {ROLE_BASE: measure_tandem(chunks, reference, dtype=dtype,
                                                                  linear_kernels=ROLE_BASE)}}
    for role, attr in ROLES.items():
        matrix[role] = {}
        for kernel in fits[role]:
            wanted = kernel in kernels if kernels else SAME_AS.get(kernel) not in fits[role]
            if kernel == "linear" or not wanted:
                continue
            print(f"  {role} on {kernel} ...", flush=True)
            matrix[role][kernel] = measure_tandem(chunks, reference, dtype=dtype,
                                                  linear_kernels=f"{ROLE_BASE},{attr}={kernel}")
            gc.collect()
            out.write_text(json.dumps({"dtype": dtype, "roles": matrix}, indent=1))
    return matrix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--linear-kernels", action="append", default=[], metavar="SPEC",
                        help="one more Tandem row with these kernels pinned (tandem-engine's --linear-kernels; "
                             "repeatable), in --dtype")
    parser.add_argument("--roles", action="store_true",
                        help="also each kernel forced on each layer role, the rest on F.linear, in --dtype "
                             "(~30 min on 2 busy cores)")
    parser.add_argument("--roles-kernels", type=lambda text: text.split(","), metavar="K1,K2",
                        help="the matrix's kernels (default: every kernel but those repeating another's arithmetic)")
    parser.add_argument("--kv-cache-dtype", action="append", default=[], metavar="KV",
                        help="one more Tandem row with this KV cache dtype (tandem-engine's --kv-cache-dtype; "
                             "repeatable), in --dtype, and its baseline (the same over the model's own cache dtype)")
    parser.add_argument("--dtype", default="auto",
                        help="of the --linear-kernels and --kv-cache-dtype rows and the matrix (default: auto)")
    parser.add_argument("--skip-main", action="store_true",
                        help="without the seven standard Tandem rows and llama.cpp (only the reference, the "
                             "--linear-kernels rows and the matrix)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument("--output", default="bench_results/quality.json")
    args = parser.parse_args()
    os.environ.setdefault("TANDEM_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-quality-"))  # never the user's plans

    model_path = default_model_path()
    chunks, text_digest = text_token_ids(model_path)
    print(f"text: pydoc_data topics {', '.join(TOPICS)} (sha256 {text_digest}), {CHUNKS} chunks of {CHUNK}, "
          f"{CHUNKS * SCORED} scored", flush=True)
    reference = reference_logprobs(model_path, chunks)
    rows = [{"name": "fp32 reference (transformers)", "prefill": reference_summary(reference, chunks)}]
    reference_ppl = rows[0]["prefill"]["perplexity"]
    print(f"fp32 reference perplexity {reference_ppl:.3f}", flush=True)
    standard = [("Tandem default (auto)", {}), ("Tandem --dtype float32", {"dtype": "float32"}),
                ("Tandem --quantization none", {"quantization": "none"}),
                ("Tandem --quantization int4", {"quantization": "int4"}),
                ("Tandem --quantization int8", {"quantization": "int8"}),
                ("Tandem --kv-cache-dtype int8", {"kv_cache_dtype": "int8"}),
                ("Tandem --dtype float32 --kv-cache-dtype int8", {"dtype": "float32", "kv_cache_dtype": "int8"})]
    forced = [(f"Tandem --linear-kernels '{spec}'", {"dtype": args.dtype, "linear_kernels": spec})
              for spec in args.linear_kernels]
    for kv in args.kv_cache_dtype:
        baseline = ("Tandem default (auto)" if args.dtype == "auto" else f"Tandem --dtype {args.dtype}",
                    {} if args.dtype == "auto" else {"dtype": args.dtype})
        named = {name for name, _ in forced} | ({name for name, _ in standard} if not args.skip_main else set())
        if baseline[0] not in named:
            forced.append(baseline)
        forced.append((f"{baseline[0]} --kv-cache-dtype {kv}", {**baseline[1], "kv_cache_dtype": kv}))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "quality against the fp32 model", "date": time.strftime("%Y-%m-%d"),
              "machine": cpu_model(), "threads": torch.get_num_threads(), "python": platform.python_version(),
              "model": str(model_path.name), "text": {"source": f"pydoc_data.topics {list(TOPICS)}",
                                                      "sha256": text_digest},
              "method": {"chunk": CHUNK, "chunks": CHUNKS, "first_scored_position": FIRST, "scored": CHUNKS * SCORED},
              "rows": rows, "roles": None}
    tops: dict[str, dict[str, list[int]]] = {}
    for name, options in ([] if args.skip_main else standard) + forced:
        print(f"{name} ...", flush=True)
        rows.append({"name": name, "options": options, **measure_tandem(chunks, reference, **options)})
        tops[name] = rows[-1].pop("argmax")
        print(f"  prefill {cells(rows[-1], 'prefill', reference_ppl)}; "
              f"decode {cells(rows[-1], 'decode', reference_ppl)}", flush=True)
        out.write_text(json.dumps(result, indent=1))  # a long run keeps what it measured
        gc.collect()
    if not (args.no_llama or args.skip_main):
        print("llama.cpp llama-perplexity ...", flush=True)
        rows.append({"name": "llama.cpp llama-perplexity (same GGUF)", **measure_llama(model_path, chunks, reference)})
    if args.roles:
        print(f"per-role matrix, dtype {args.dtype} ...", flush=True)
        result["roles"] = role_matrix(chunks, reference, args.dtype, args.roles_kernels,
                                      out.with_name(out.stem + "_roles.json"))

    result["kv_cache_dtypes"] = compare_kv_dtypes(rows, tops)
    print_table(rows, reference_ppl)
    print_kv_dtypes(result["kv_cache_dtypes"])
    for row in rows:
        if "plan" in row:
            print(f"  {row['name']} ({row['dtype']}): " + ", ".join(
                f"{role} {'/'.join(kernels.values())}" for role, kernels in row["plan"].items()))
    if result["roles"] is not None:
        print_roles(result["roles"], reference_ppl)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
