"""Which model class serves a checkpoint, by Hugging Face `architectures` or GGUF
`general.architecture`; an unknown one is an error that names the supported ones."""

from __future__ import annotations

from torch import nn

from engine_core.models.gemma import GemmaForCausalLM
from engine_core.models.llama import LlamaForCausalLM

# Hugging Face architecture -> family (ModelArchConfig.name)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
# config.json model_type -> family, for configs that name no architectures
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
# GGUF general.architecture -> family (llama.cpp writes Mistral as "llama")
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
                      "phi3": "phi3"}

_CLASSES: dict[str, type[nn.Module]] = {
    "gemma2": GemmaForCausalLM, "gemma3": GemmaForCausalLM,
}


def family_of_hf_config(cfg: dict) -> str:
    """The family of a config.json: by its first known `architectures` entry, else model_type."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    raise ValueError(
        f"model_type {cfg.get('model_type')!r} (architectures {archs}) is not supported; "
        f"supported architectures: {', '.join(HF_ARCHITECTURES)}"
    )


def family_of_gguf(arch: str | None) -> str:
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    return GGUF_ARCHITECTURES[arch]


def model_class(family: str) -> type[nn.Module]:
    """The causal-LM class of a family; Llama's serves every family without its own."""
    return _CLASSES.get(family, LlamaForCausalLM)
