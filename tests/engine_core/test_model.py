"""LlamaForCausalLM over paged KV vs transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from engine_core.loader import load_model
from kernels import select_backend
from tests.engine_core.tiny_models import PagedBatch, run_step, write_tiny_model

ATOL = 1e-4

VARIANTS = {
    "gqa2-untied": dict(num_kv_heads=2),
    "mha-tied": dict(num_kv_heads=4, tie_word_embeddings=True),
    "gqa4-llama3-rope": dict(
        num_kv_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(model_type="qwen2", tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(ours, transformers reference, our arch config) for one tiny checkpoint."""
    import transformers

    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    ours, config = load_model(str(folder), torch.float32, torch.device("cpu"), select_backend("cpu", "torch"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, ref, config


def reference_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()  # [L, vocab]


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_single_prompt(models):
    ours, ref, config = models
    (prompt,) = prompts(config.vocab_size, [11])
    (logits,) = run_step(ours, PagedBatch(config, 1, 16), [(0, prompt)])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(ref, prompt), atol=ATOL, rtol=0)


def test_ragged_batch_then_mixed_decode_step(models):
    ours, ref, config = models
    seqs = prompts(config.vocab_size, [5, 13, 9, 12])
    batch = PagedBatch(config, len(seqs), 48)
    # step 1: three prompts in one flattened batch; the fourth gets only a first chunk
    first = [(0, seqs[0]), (1, seqs[1]), (2, seqs[2]), (3, seqs[3][:7])]
    for (req, tokens), logits in zip(first, run_step(ours, batch, first)):
        torch.testing.assert_close(logits, reference_logits(ref, tokens), atol=ATOL, rtol=0)
    # step 2: decodes from cached KV, then the rest of the fourth prompt as a chunk
    for seq, token in zip(seqs, [7, 8, 9]):
        seq.append(token)
    second = [(0, seqs[0][-1:]), (1, seqs[1][-1:]), (2, seqs[2][-1:]), (3, seqs[3][7:])]
    for (req, tokens), logits in zip(second, run_step(ours, batch, second)):
        expected = reference_logits(ref, seqs[req])[-len(tokens):]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_loop_matches_full_sequence(models):
    ours, ref, config = models
    (seq,) = prompts(config.vocab_size, [6], seed=1)
    batch = PagedBatch(config, 1, 32, block_size=2)
    (logits,) = run_step(ours, batch, [(0, seq)])
    for _ in range(5):  # greedy decode: every step reads all earlier K/V from the paged cache
        seq.append(int(logits[-1].argmax()))
        (logits,) = run_step(ours, batch, [(0, seq[-1:])])
    torch.testing.assert_close(logits[-1], reference_logits(ref, seq)[-1], atol=ATOL, rtol=0)


def test_tied_embeddings_give_the_lm_head_the_embedding(models):
    ours, _, config = models
    # on CPU a tied LM head is a measured linear over the embedding (see prepare_for_cpu)
    hidden = torch.randn(3, config.hidden_size)
    via_embedding = torch.nn.functional.linear(hidden, ours.model.embed_tokens.weight).float()
    tied = torch.allclose(ours.compute_logits(hidden), via_embedding, atol=1e-4, rtol=1e-4)
    assert tied == config.tie_word_embeddings
