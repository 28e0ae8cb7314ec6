"""Test helper: a GGUF twin of a tiny Hugging Face checkpoint, written with the `gguf` package.

Tensor names, metadata keys and Llama's Q/K row permutation follow llama.cpp's
convert_hf_to_gguf.py, so our loader reads the file as it would a real one. `quantized`
makes raw quantized rows of any GGML type (random K-quant blocks where gguf has no
quantizer) for dequantization tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.numpy import load_file

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
# where each K-quant block keeps its fp16 scale(s): byte offsets
_F16_FIELDS = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}


def gguf_name(hf_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'."""
    globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, _, kind = hf_name.rpartition(".")
    if module in globals_:
        return f"{globals_[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{kind}"


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Llama Q/K permutation (rotate_half -> interleaved rope pairs)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def quantized(values: np.ndarray, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows of `qtype` for a float [rows, cols] array: gguf's quantizer where it has
    one, else random blocks with small finite fp16 scales (the K-quants)."""
    if qtype not in _F16_FIELDS:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(values.shape[0], -1)


def write_gguf_twin(folder: Path, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write `path` (.gguf) holding the Llama, Qwen2 or Qwen3 checkpoint in `folder`; 2-D weights in
    `qtype`, norms and biases in F32."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, tensor in load_file(folder / "model.safetensors").items():
        if arch == "llama" and ".q_proj." in name:
            tensor = permute(tensor, heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = permute(tensor, kv_heads)
        if tensor.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), quantized(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
