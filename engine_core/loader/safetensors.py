"""Hugging Face checkpoint folders: config.json -> ModelArchConfig, *.safetensors -> weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from engine_core.config import ModelArchConfig
from engine_core.models.llama import packed_groups
from engine_core.models.registry import family_of_hf_config


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
    family = family_of_hf_config(cfg)
    if cfg.get("quantization_config") or cfg.get("mlp_bias"):
        raise ValueError(f"{path}: quantized checkpoints and mlp_bias are not supported")
    gemma = family.startswith("gemma")
    act = cfg.get("hidden_activation" if gemma else "hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"{path}: activation {act!r} is not supported for {family}")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope_theta, rope_scaling, local_theta = _rope(cfg)
    layer_types = _layer_types(cfg, family)
    sliding = "sliding_attention" in layer_types
    return ModelArchConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        attention_bias=family == "qwen2" or cfg.get("attention_bias", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(cfg, path.with_name("generation_config.json")),
        name=family,
        layer_types=tuple(layer_types) if sliding else (),
        sliding_window=cfg["sliding_window"] if sliding else None,
        rope_local_theta=local_theta,
        qk_norm=family in ("qwen3", "gemma3"),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
        attn_logit_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
    )


def _rope(cfg: dict) -> tuple[float, dict | None, float | None]:
    """(rope base, scaling or None, local layers' base or None) from the v5 `rope_parameters`
    (flat, or per layer type as Gemma 3 writes it) or the v4 rope_theta / rope_scaling /
    rope_local_base_freq keys."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in params:  # per layer type
        local = params.get("sliding_attention", {}).get("rope_theta")
        params = params["full_attention"]
    rope = dict(params or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    local = local or cfg.get("rope_local_base_freq")
    rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if rope_type == "longrope":
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        rope.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
    scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    return theta, scaling, None if local == theta else local


def _layer_types(cfg: dict, family: str) -> list[str]:
    """Per layer "sliding_attention" | "full_attention": config.json's `layer_types` when it
    has them, else what each family's transformers config derives."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if not window:
        return ["full_attention"] * n
    if family == "gemma2":
        sliding = [i % 2 == 0 for i in range(n)]
    elif family == "gemma3":
        sliding = [(i + 1) % cfg.get("sliding_window_pattern", 6) != 0 for i in range(n)]
    elif family in ("qwen2", "qwen3"):
        sliding = [cfg.get("use_sliding_window", False) and i >= cfg.get("max_window_layers", n) for i in range(n)]
    else:  # Mistral, Phi-3: every layer when a window is set
        sliding = [True] * n
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _eos_token_ids(cfg: dict, generation_config: Path) -> tuple[int, ...]:
    """config.json's eos_token_id (int or list) plus generation_config.json's, if any."""
    ids = []
    extra = json.loads(generation_config.read_text()) if generation_config.is_file() else {}
    for eos in (cfg.get("eos_token_id"), extra.get("eos_token_id")):
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(ids))


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Model-named tensors: q/k/v and gate/up concatenated as `packed_groups` says."""
    handles = [safe_open(file, framework="pt", device="cpu") for file in files]
    where = {name: handle for handle in handles for name in handle.keys()}
    for param, names in packed_groups(where).items():
        tensors = [where[name].get_tensor(name) for name in names]
        yield param, tensors[0] if len(tensors) == 1 else torch.cat(tensors)
