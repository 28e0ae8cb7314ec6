"""GGUF checkpoints: tiny Llama, Qwen2, Qwen3, Gemma 2/3 and Phi-3 GGUF twins written with the `gguf` package load and
match their safetensors originals, and every supported quant type dequantizes (fused groups,
Llama's permuted Q/K rows) exactly as the gguf package's own dequantize gives tensor by tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from engine_core.config import ModelArchConfig
from engine_core.loader import load_model
from engine_core.loader.gguf import GGUFFile, GGUFTensor, _iter_weights, load_gguf, read_gguf
from engine_core.loader.safetensors import load_hf
from kernels import select_backend
from tests.engine_core.tiny_gguf import gguf_name, permute, quantized, write_gguf_twin
from tests.engine_core.tiny_models import PagedBatch, run_step, write_tiny_model

TORCH = select_backend("cpu", "torch")
CPU = torch.device("cpu")
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


_WINDOW = dict(sliding_window=8, head_dim=16)
TWINS = {  # family: options of its tiny checkpoint (Gemma's query_pre_attn_scalar = head_dim, as llama.cpp assumes)
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 32},
    "gemma2": dict(**_WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                   tie_word_embeddings=True),
    "gemma3": dict(**_WINDOW, num_layers=7, query_pre_attn_scalar=16, tie_word_embeddings=True,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    "phi3": dict(sliding_window=8, original_max_position_embeddings=64, pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
}
_SAME_CONFIG = ("layer_types", "sliding_window", "rope_local_theta", "qk_norm", "query_pre_attn_scalar",
                "attn_logit_softcap", "final_logit_softcap", "attention_bias", "head_dim", "tie_word_embeddings")


@pytest.mark.parametrize("model_type", list(TWINS))
def test_gguf_twin_matches_safetensors(tmp_path, model_type):
    folder = write_tiny_model(tmp_path / "hf", model_type=model_type, vocab_size=64, **TWINS[model_type])
    path = write_gguf_twin(folder, tmp_path / "twin.gguf")
    hf_model, hf_config = load_model(str(folder), torch.float32, CPU, TORCH)
    gguf_model, gguf_config = load_model(str(path), torch.float32, CPU, TORCH)
    assert gguf_config.name == hf_config.name == model_type
    for field in _SAME_CONFIG:
        assert getattr(gguf_config, field) == getattr(hf_config, field), field
    assert (gguf_config.rope_scaling or {}).get("rope_type") == (hf_config.rope_scaling or {}).get("rope_type")
    hf_weights, gguf_weights = dict(load_hf(folder)[1]), dict(load_gguf(path)[1])
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()  # convert drops a tied head
    assert set(gguf_weights) == set(hf_weights) - tied
    for name, tensor in gguf_weights.items():  # Gemma's norms: 1 + w stored, w back (one rounding)
        torch.testing.assert_close(tensor, hf_weights[name], atol=3e-7, rtol=0, msg=name)
    prompt = torch.randint(0, 64, (21,), generator=torch.Generator().manual_seed(0)).tolist()  # past the window
    (ours,) = run_step(gguf_model, PagedBatch(gguf_config, 1, 24), [(0, prompt)])
    (twin,) = run_step(hf_model, PagedBatch(hf_config, 1, 24), [(0, prompt)])
    torch.testing.assert_close(ours, twin, atol=1e-4, rtol=0)


def test_gguf_q8_0_twin_loads_close_to_safetensors(tmp_path):
    folder = write_tiny_model(tmp_path / "hf", vocab_size=64)
    hf_weights = dict(load_hf(folder)[1])
    gguf_weights = dict(load_gguf(write_gguf_twin(folder, tmp_path / "q8.gguf", Q.Q8_0))[1])
    weight = "model.layers.0.self_attn.qkv_proj.weight"
    error = (gguf_weights[weight] - hf_weights[weight]).abs().max()
    assert 0 < error < 2e-3  # 8-bit rounding of values around 0.1: present and small


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dequantization_matches_gguf_per_tensor(qtype, arch):
    """Our loader stacks raw quantized rows of q/k/v and gate/up (and unpermutes Llama's Q/K
    in the raw rows) before one dequantize; that must equal gguf's dequantize of each tensor,
    then the same concatenation in floats. Rows of 256 values fit every block size."""
    config = ModelArchConfig(vocab_size=8, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             max_position_embeddings=32, name=arch)
    rng = np.random.default_rng(0)
    shapes = {"self_attn.q_proj": 256, "self_attn.k_proj": 128, "self_attn.v_proj": 128,
              "self_attn.o_proj": 256, "mlp.gate_proj": 256, "mlp.up_proj": 256, "mlp.down_proj": 256}
    tensors, expected = {}, {}
    for i, (module, rows) in enumerate(shapes.items()):
        raw = quantized(rng.standard_normal((rows, 256)).astype(np.float32) * 0.1, qtype, seed=i)
        name = f"model.layers.0.{module}.weight"
        tensors[gguf_name(name)] = GGUFTensor(qtype, raw)
        floats = dequantize(raw, qtype)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = 4 if module == "self_attn.q_proj" else 2
            floats = _unpermute_floats(floats, heads)
        expected[name] = floats
    ours = dict(_iter_weights(GGUFFile({}, tensors), config))
    prefix = "model.layers.0."
    fused = {
        "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
        "self_attn.o_proj": ["self_attn.o_proj"], "mlp.down_proj": ["mlp.down_proj"],
    }
    assert set(ours) == {f"{prefix}{param}.weight" for param in fused}
    for param, parts in fused.items():
        want = np.concatenate([expected[f"{prefix}{p}.weight"] for p in parts])
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(ours[f"{prefix}{param}.weight"].numpy(), want, err_msg=param)


def _unpermute_floats(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of convert_hf_to_gguf's permute, found by permuting row indices."""
    order = permute(np.arange(rows.shape[0]), n_head)
    out = np.empty_like(rows)
    out[order] = rows
    return out


def test_gguf_unknown_architecture_names_the_supported(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = r"\(supported: llama, qwen2, qwen3, gemma2, gemma3, phi3\)"
    with pytest.raises(ValueError, match=r"'mamba' is not supported " + supported):
        load_model(str(tmp_path / "x.gguf"), torch.float32, CPU, TORCH)
    assert read_gguf(tmp_path / "x.gguf").metadata["general.architecture"] == "mamba"
