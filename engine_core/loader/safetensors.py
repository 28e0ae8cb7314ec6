"""Hugging Face checkpoint folders: config.json -> ModelArchConfig, *.safetensors -> weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from engine_core.config import ModelArchConfig
from engine_core.models.llama import packed_groups

_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def load_hf(folder: str | Path) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Read a Hugging Face folder: its architecture and an iterator of model-named tensors."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return read_hf_config(folder / "config.json"), _iter_tensors(files)


def read_hf_config(path: str | Path) -> ModelArchConfig:
    """Map a Hugging Face config.json (transformers 4 or 5 layout) onto ModelArchConfig."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Hugging Face model folder needs config.json")
    cfg: dict[str, Any] = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {_SUPPORTED_MODEL_TYPES})")
    if cfg.get("quantization_config") or cfg.get("mlp_bias"):
        raise ValueError(f"{path}: quantized checkpoints and mlp_bias are not supported")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})  # v5 | v4 layout
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
    return ModelArchConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=_max_positions(cfg),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(cfg, path.with_name("generation_config.json")),
        name=model_type,
    )


def _eos_token_ids(cfg: dict, generation_config: Path) -> tuple[int, ...]:
    """config.json's eos_token_id (int or list) plus generation_config.json's, if any."""
    ids = []
    extra = json.loads(generation_config.read_text()) if generation_config.is_file() else {}
    for eos in (cfg.get("eos_token_id"), extra.get("eos_token_id")):
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(ids))


def _max_positions(cfg: dict) -> int:
    """The context length; a sliding window (Mistral v0.1, Qwen2 when on) caps it, as we
    attend over the full context."""
    length = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", cfg["model_type"] == "mistral")
    return min(length, window) if window and uses_window else length


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Model-named tensors: q/k/v and gate/up concatenated as `packed_groups` says."""
    handles = [safe_open(file, framework="pt", device="cpu") for file in files]
    where = {name: handle for handle in handles for name in handle.keys()}
    for param, names in packed_groups(where).items():
        tensors = [where[name].get_tensor(name) for name in names]
        yield param, tensors[0] if len(tensors) == 1 else torch.cat(tensors)
