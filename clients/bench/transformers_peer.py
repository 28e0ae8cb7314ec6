"""Hugging Face transformers `generate` as a peer: static batches, greedy, exactly gen_len tokens.

Shared by `tandem bench --side-by-side` and scripts/bench_offline.py. Imports torch and
transformers only when called.
"""

from __future__ import annotations

import time
from pathlib import Path


def transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None


def load_transformers(model_path: str | Path, dtype):
    """A causal LM from a Hugging Face folder or a GGUF file (dequantized on load), in eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def generate_batch(model, prompts: list[list[int]], gen_len: int) -> dict:
    """One static batch (left-padded when lengths differ); wall time covers prefill and decode."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=gen_len,
                             min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - started
    generated = (out.shape[1] - width) * out.shape[0]
    return {"seconds": elapsed, "generated_tokens": generated, "tok_per_s": generated / elapsed}
