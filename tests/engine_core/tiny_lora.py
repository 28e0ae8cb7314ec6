"""Test helpers: random non-zero LoRA adapters made with peft on a checkpoint, and peft's merged model.

`write_tiny_adapter` wraps the checkpoint in peft with `init_lora_weights=False` (A and B random,
so the adapter changes every output) and saves the adapter folder as users get it from training
(adapter_config.json + adapter_model.safetensors); `merged_model` loads it back onto the base and
returns `merge_and_unload()`'s plain transformers model: the reference a served adapter must match.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_tiny_adapter(base_folder: str | Path, folder: str | Path, *, rank: int = 8, alpha: float = 16,
                       target_modules: list[str] | None = None, use_rslora: bool = False, seed: int = 0,
                       scale: float = 1.0, **lora_options) -> Path:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or ALL_LINEAR,
                             use_rslora=use_rslora, init_lora_weights=False, **lora_options)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # random, and sized so the adapter moves the logits without swamping the base
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale / param.shape[-1] ** 0.5)
    wrapped.save_pretrained(folder)
    return Path(folder)


def merged_model(base_folder: str | Path, adapter_folder: str | Path):
    """The base with the adapter merged into its weights (peft's merge_and_unload), fp32, eval."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, adapter_folder).merge_and_unload().eval()
    merged.generation_config.eos_token_id = None  # fixed-length greedy continuations
    return merged
