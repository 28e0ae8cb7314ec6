"""Test helper: a GGUF twin of a tiny Hugging Face checkpoint, written with the `gguf` package.

Tensor names (from the gguf package's own name map), metadata keys, Llama's Q/K row
permutation, Gemma's 1 + w norms and Phi-3's rope-factor tensors follow llama.cpp's
convert_hf_to_gguf.py, so our loader reads the file as it would a real one. `quantized`
makes raw quantized rows of any GGML type (random K-quant blocks where gguf has no
quantizer) for dequantization tests.
"""

from __future__ import annotations

import json
import math
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
    """Write `path` (.gguf) holding the checkpoint in `folder` as llama.cpp's convert would: gguf's
    own tensor-name map, Llama's permuted Q/K, Gemma's norms stored as 1 + w, Phi-3's LongRoPE
    factors as tensors; 2-D weights in `qtype`, norms and biases in F32."""
    cfg = json.loads((folder / "config.json").read_text())
    family = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    writer = gguf.GGUFWriter(str(path), family)
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
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(writer, f"add_{key}")(cfg[key])
    if family in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if family == "phi3":
        original = cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], cfg["num_hidden_layers"])
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if family == "llama" and ".q_proj." in name:
            tensor = permute(tensor, heads)
        elif family == "llama" and ".k_proj." in name:
            tensor = permute(tensor, kv_heads)
        elif family.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        gguf_tensor_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if tensor.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name, quantized(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name, tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
