"""The quality benchmark's own machinery (scripts/bench_quality.py): the tap that teacher-forces Tandem's
prefill and decode paths scores exactly the predictions llama.cpp's method scores, and the base file handed
to llama-perplexity holds our token ids and reference log-probs in its format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.config import DeviceConfig
from scripts import bench_quality
from scripts.bench_quality import CHUNK, CHUNKS, FIRST, SCORED
from tests.engine_core.tiny_models import write_tiny_model


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def tiny_text(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (CHUNKS, CHUNK), generator=generator).tolist()


def test_the_fp32_path_scores_every_prediction_as_transformers_does(tmp_path):
    folder = write_tiny_model(tmp_path / "tiny", vocab_size=256, max_position_embeddings=1024)
    chunks = tiny_text(256)
    reference = bench_quality.reference_logprobs(folder, chunks)
    assert reference.shape == (CHUNKS, SCORED, 256)
    expected = bench_quality.reference_summary(reference, chunks)
    got = bench_quality.measure_tandem(  # plain torch ops: nothing to compile, nothing timed
        chunks, reference, dtype="float32", linear_kernels="*=linear", model=str(folder),
        device=DeviceConfig(device="cpu", attention_backend="torch", enforce_eager=True))
    for mode in ("prefill", "decode"):  # decode: the text fed one token per step, 8 sequences at once
        scores = got[mode]
        assert scores["scored"] == CHUNKS * SCORED == 2040
        assert scores["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-4)
        assert scores["top1_agreement"] == 1.0 and scores["kl_divergence"] < 1e-6
        assert scores["mean_abs_logprob_change"] < 1e-4


def test_the_llama_base_file_holds_our_ids_and_reference(tmp_path):
    vocab = 40
    chunks = tiny_text(vocab)
    reference = torch.log_softmax(torch.randn(CHUNKS, SCORED, vocab) * 4, dim=-1)
    path = tmp_path / "base.kld"
    bench_quality.write_llama_base(path, chunks, reference)
    data = path.read_bytes()
    assert data[:8] == b"_logits_"
    n_ctx, = np.frombuffer(data, np.uint32, 1, 8)
    n_vocab, n_chunk = np.frombuffer(data, np.int32, 2, 12)
    assert (n_ctx, n_vocab, n_chunk) == (CHUNK, vocab, CHUNKS)
    tokens = np.frombuffer(data, np.int32, CHUNK * CHUNKS, 20)
    assert tokens.reshape(CHUNKS, CHUNK).tolist() == chunks
    records = np.frombuffer(data, np.uint16, offset=20 + 4 * CHUNK * CHUNKS).reshape(CHUNKS, SCORED, vocab + 4)
    scale_and_min = records[..., :4].copy().view(np.float32)  # as llama.cpp reads them back
    decoded = scale_and_min[..., :1] * records[..., 4:] + scale_and_min[..., 1:]
    kept = reference.numpy() >= reference.numpy().max(-1, keepdims=True) - 16  # llama.cpp keeps 16 nats
    assert np.abs(decoded - reference.numpy())[kept].max() <= scale_and_min[..., :1].max()
    assert FIRST == CHUNK // 2


def test_each_kv_dtype_row_is_compared_with_its_baseline():
    def row(name, options, kv, ppl):
        return {"name": name, "options": options, "kv_cache_dtype": kv,
                "prefill": {"perplexity": ppl}, "decode": {"perplexity": ppl * 2}}

    rows = [row("auto", {}, "bf16", 10.0), row("fp32", {"dtype": "float32"}, "fp32", 9.0),
            row("int8", {"kv_cache_dtype": "int8"}, "int8", 10.1),
            row("fp32 int8", {"dtype": "float32", "kv_cache_dtype": "int8"}, "int8", 9.0)]
    tops = {"auto": {"prefill": [1, 2, 3, 4], "decode": [1, 1, 1, 1]}, "fp32": {"prefill": [5] * 4, "decode": [5] * 4},
            "int8": {"prefill": [1, 2, 3, 0], "decode": [1, 1, 1, 1]}, "fp32 int8": {"prefill": [5] * 4,
                                                                                    "decode": [5, 5, 0, 0]}}
    first, second = bench_quality.compare_kv_dtypes(rows, tops)
    assert (first["baseline"], second["baseline"]) == ("auto", "fp32")
    assert first["prefill"]["top1_agreement"] == 0.75 and first["decode"]["top1_agreement"] == 1.0
    assert first["prefill"]["perplexity_change"] == pytest.approx(0.01)
    assert second["decode"]["top1_agreement"] == 0.5 and second["prefill"]["perplexity_change"] == 0.0
