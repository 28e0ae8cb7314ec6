"""Tandem next to its peers in one run, on the same prompts: Tandem over gRPC, the in-process
frontend core over the engine (same weights, no gRPC), HF transformers static batches (where installed) and a
llama.cpp server (where one is given). Ratios are Tandem's figure over the peer's.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import replace
from pathlib import Path

from clients.bench.backends import InProcessBackend
from clients.bench.metrics import RequestRecord
from clients.bench.prompts import BenchPrompt


def with_token_ids(client, prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Every prompt with both text and token ids (the server's tokenizer, a TandemClient, fills in
    what is missing), so that every backend gets the same tokens."""
    result = []
    for p in prompts:
        ids = p.token_ids if p.token_ids is not None else client.tokenize(p.text).token_ids
        text = p.text if p.text is not None else client.detokenize(ids)
        result.append(replace(p, text=text, token_ids=tuple(ids)))
    return result


def make_in_process_backend(model_path: str, tokenizer_path: str, dtype: str, max_model_len: int,
                            max_num_seqs: int) -> InProcessBackend:
    return InProcessBackend(model_path, tokenizer_path, dtype=dtype, max_model_len=max_model_len,
                            max_num_seqs=max_num_seqs)


def transformers_closed_loop(model, prompts: list[BenchPrompt], concurrency: int, progress) -> tuple[list, float]:
    """Static batches of `concurrency` prompts, one after another (transformers has no continuous batching).
    Each request's e2e is its batch's wall time; it streams nothing, so it has no TTFT."""
    from clients.bench.transformers_peer import generate_batch

    records, started = [], time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        batch = prompts[first:first + concurrency]
        batch_start = time.perf_counter()
        generate_batch(model, [list(p.token_ids) for p in batch], max(p.max_tokens for p in batch))
        end = time.perf_counter()
        for p in batch:
            records.append(RequestRecord(start=batch_start, prompt_tokens=len(p.token_ids),
                                         output_tokens=p.max_tokens, end=end))
            progress()
    return records, time.perf_counter() - started


def ratios(tandem: dict, peer: dict) -> dict:
    """Tandem / peer for throughput (higher is better for Tandem) and latency (lower is better)."""
    def over(a, b):
        return a / b if a is not None and b not in (None, 0) else None

    return {
        "output_token_throughput": over(tandem["output_token_throughput"], peer["output_token_throughput"]),
        "ttft_p50": over(tandem["ttft"]["p50_ms"], peer["ttft"]["p50_ms"]),
        "e2e_p50": over(tandem["e2e"]["p50_ms"], peer["e2e"]["p50_ms"]),
    }


def peers_available(model_path: str, llama_url: str | None, want_in_process: bool,
                    want_transformers: bool, tokenizer_path: str | None = None) -> dict[str, str]:
    """Which peers run, and for those that do not, why (shown in the report).
    The in-process frontend reads its tokenizer from `tokenizer_path` (default: the model's own)."""
    notes = {}
    local = Path(model_path).exists()
    has_torch = importlib.util.find_spec("torch") is not None
    tokenizer = Path(tokenizer_path or model_path)
    if not want_in_process:
        notes["in-process"] = "skipped (--no-in-process)"
    elif not has_torch:
        notes["in-process"] = "skipped: needs the engine here (pip install 'tandem[engine]')"
    elif not local:
        notes["in-process"] = f"skipped: needs the model at {model_path} on this machine"
    elif not (tokenizer.suffix == ".gguf" and tokenizer.is_file() or (tokenizer / "tokenizer.json").is_file()):
        notes["in-process"] = f"skipped: no tokenizer at {tokenizer}; pass --tokenizer"
    if not want_transformers:
        notes["transformers"] = "skipped (--no-transformers)"
    elif not (local and importlib.util.find_spec("transformers") is not None and has_torch):
        notes["transformers"] = "skipped: transformers (or the model files) not installed here"
    if not llama_url:
        notes["llama.cpp-server"] = "skipped: no --llama-server URL given"
    return notes

