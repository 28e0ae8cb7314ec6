"""GGUF checkpoints: metadata -> ModelArchConfig, tensors -> Hugging Face-named fp32 weights.

The header comes from `engine_core.text.gguf_metadata` (the one GGUF header reader, shared with the
frontend); the `gguf` package supplies the type tables and `gguf.quants.dequantize`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine_core.config import ModelArchConfig
from engine_core.models.llama import packed_groups
from engine_core.models.registry import family_of_gguf
from engine_core.text.gguf_metadata import read_gguf_header

# Tokens that end a turn, added to eos like llama.cpp's end-of-generation set.
_EOG_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# where a family's llama.cpp names mean something else (Gemma's ffn_norm is its pre-MLP norm)
_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_FAMILY_BLOCK_NAMES = {
    "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused in the file
}
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE, as tensors


@dataclass(frozen=True)
class GGUFTensor:
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw bytes, uint8 [..., bytes per row] (numpy order: GGUF dims reversed)


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


# ---- reading the file -------------------------------------------------------------------


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a little-endian GGUF v2/v3 file; tensor data stays memory-mapped."""
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    start = header.data_start
    tensors = {}
    for name, dims, qtype, offset in header.tensors:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block_size * type_size
        rows = [int(d) for d in reversed(dims[1:])]
        nbytes = row_bytes * int(np.prod(rows, dtype=np.int64))
        raw = data[start + offset : start + offset + nbytes]
        tensors[name] = GGUFTensor(qtype, raw.view(np.ndarray).reshape(*rows, row_bytes))
    return GGUFFile(header.metadata, tensors)


# ---- metadata -> ModelArchConfig ---------------------------------------------------------


def arch_config(gguf: GGUFFile) -> ModelArchConfig:
    """Read `{arch}.*` and `tokenizer.ggml.*` keys into a ModelArchConfig."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    family = family_of_gguf(arch)
    if "rope_freqs.weight" in gguf.tensors:
        raise ValueError("GGUF rope_freqs (Llama 3.1-style rope scaling as a tensor) is not supported yet")

    def get(key: str, default: Any = KeyError) -> Any:
        if f"{arch}.{key}" in meta:
            return meta[f"{arch}.{key}"]
        if default is KeyError:
            raise KeyError(f"GGUF metadata lacks {arch}.{key}")
        return default

    tokens = meta.get("tokenizer.ggml.tokens", [])
    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    return ModelArchConfig(
        vocab_size=get("vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=_longrope(gguf, get) or _rope_scaling(get("rope.scaling.type", None),
                                                           get("rope.scaling.factor", None)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(meta, tokens),
        name=family,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        **_window_fields(family, get, layers, hidden // heads, head_dim),
    )


def _window_fields(family: str, get, layers: int, hidden_per_head: int, head_dim: int) -> dict:
    """Sliding layers, Gemma's soft-caps and attention scale, as llama.cpp derives them: Gemma 2
    slides on every other layer, Gemma 3 on five of six, Phi-3 on all (window 0: none); the
    27B Gemmas (46 / 62 layers) scale by hidden / heads, the others by head_dim."""
    fields: dict = {}
    window = get("attention.sliding_window", 0)
    if window and family in ("gemma2", "gemma3", "phi3"):
        pattern = get("attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6, "phi3": 1}[family])
        sliding = ([bool(s) for s in pattern] if isinstance(pattern, list)
                   else [pattern == 1 or i % pattern < pattern - 1 for i in range(layers)])
        fields.update(sliding_window=window,
                      layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding))
    if family.startswith("gemma"):
        big = (family, layers) in (("gemma2", 46), ("gemma3", 62))
        fields.update(query_pre_attn_scalar=hidden_per_head if big else head_dim,
                      attn_logit_softcap=get("attn_logit_softcapping", None),
                      final_logit_softcap=get("final_logit_softcapping", None))
    if family == "gemma3":
        fields["rope_local_theta"] = get("rope.freq_base_swa", 10000.0)  # llama.cpp's default for local layers
    return fields


def _longrope(gguf: GGUFFile, get) -> dict | None:
    """Phi-3's LongRoPE: the factors are tensors, the rest metadata."""
    if _ROPE_FACTORS[0] not in gguf.tensors:
        return None
    long, short = (dequantize(gguf.tensors[name].data, gguf.tensors[name].qtype).tolist() for name in _ROPE_FACTORS)
    return {"rope_type": "longrope", "long_factor": long, "short_factor": short,
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "max_position_embeddings": get("context_length"), "attention_factor": get("rope.scaling.attn_factor", None)}


def _rope_scaling(kind: str | None, factor: float | None) -> dict | None:
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear)")
    return {"rope_type": "linear", "factor": factor}


def _eos_token_ids(meta: dict, tokens: list[str]) -> tuple[int, ...]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [meta[k] for k in keys if k in meta]
    ids += [i for i, token in enumerate(tokens) if token in _EOG_TOKENS]
    return tuple(dict.fromkeys(ids))  # unique, in order


# ---- tensors -> Hugging Face-named weights ------------------------------------------------


def load_gguf(path: str | Path) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Parse a GGUF file: its architecture and an iterator of model-named fp32 weights."""
    gguf = read_gguf(path)
    config = arch_config(gguf)
    return config, _iter_weights(gguf, config)


def _iter_weights(gguf: GGUFFile, config: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Model-named fp32 tensors. Fused groups (q/k/v, gate/up) are stacked as raw quantized
    rows and dequantized once, straight into the fused tensor."""
    by_hf_name = {hf_name(name, config.name): tensor for name, tensor in gguf.tensors.items()
                  if name not in _ROPE_FACTORS}

    def convert(item: tuple[str, list[str]]) -> tuple[str, torch.Tensor]:
        param, names = item
        shards = [(name, by_hf_name[name]) for name in names]
        qtypes = {tensor.qtype for _, tensor in shards}
        if len(qtypes) == 1 and shards[0][1].data.ndim == 2:  # rows are quantized independently
            rows = np.concatenate([_unpermute(name, tensor.data, config) for name, tensor in shards])
            weight = dequantize(rows, qtypes.pop())
        else:
            weight = np.concatenate(
                [_unpermute(name, dequantize(tensor.data, tensor.qtype), config) for name, tensor in shards]
            )
        if config.name.startswith("gemma") and param.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp's convert stores Gemma's 1 + w; the model adds the 1 itself
        return param, torch.from_numpy(weight)  # concatenate copied: writable, off the mapped file

    groups = packed_groups(by_hf_name)
    # numpy releases the GIL while dequantizing, so threads overlap the work
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield from pool.map(convert, groups.items())


def _unpermute(name: str, rows: np.ndarray, config: ModelArchConfig) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` of Llama Q/K rows (it interleaves each head's two
    rotary halves for llama.cpp's rope) to get Hugging Face's rotate_half layout back.
    A row permutation, so it works on fp32 rows and on raw quantized rows alike."""
    if config.name != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return rows
    n_head = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
    n = rows.shape[0]
    return rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_name(gguf_name: str, family: str = "llama") -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    names = {**_BLOCK_NAMES, **_FAMILY_BLOCK_NAMES.get(family, {})}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")
