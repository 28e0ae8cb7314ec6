"""Tandem next to its peers in one run, on the same prompts: Tandem over gRPC, the in-process
LLMEngine (same weights, no transport), HF transformers static batches (where installed) and a
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


def make_in_process_backend(model_path: str, dtype: str, max_model_len: int, max_num_seqs: int) -> InProcessBackend:
    from engine_core.config import EngineConfig, ModelConfig, SchedulerConfig
    from engine_core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model_path, dtype=dtype, max_model_len=max_model_len),
                                    scheduler=SchedulerConfig(max_num_seqs=max(max_num_seqs, 1))))
    return InProcessBackend(engine)


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
                    want_transformers: bool) -> dict[str, str]:
    """Which peers run, and for those that do not, why (shown in the report)."""
    notes = {}
    local = Path(model_path).exists()
    has_torch = importlib.util.find_spec("torch") is not None
    if not want_in_process:
        notes["in-process"] = "skipped (--no-in-process)"
    elif not has_torch:
        notes["in-process"] = "skipped: needs the engine here (pip install 'tandem[engine]')"
    elif not local:
        notes["in-process"] = f"skipped: needs the model at {model_path} on this machine"
    if not want_transformers:
        notes["transformers"] = "skipped (--no-transformers)"
    elif not (local and importlib.util.find_spec("transformers") is not None and has_torch):
        notes["transformers"] = "skipped: transformers (or the model files) not installed here"
    if not llama_url:
        notes["llama.cpp-server"] = "skipped: no --llama-server URL given"
    return notes

