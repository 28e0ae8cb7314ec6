"""Every supported family against transformers on tiny random checkpoints (fp32, CPU).

Each family is built with transformers' own config and model classes, with a sliding
window of 8 wherever the family has one, so the prompts (up to 30 tokens) run past it.
Checked on the torch reference, the C++ kernels and Triton (on the GPU, or in its CPU
interpreter): logits of a chunked, ragged paged batch within 1e-4, and the whole engine's
greedy tokens (chunked prefill, a shared prefix served from the prefix cache) identical to
transformers' generate with logprobs within 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.loader import load_model
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import OutputKind, SamplingParams
from kernels import select_backend
from kernels.cpu import extension as cpu_extension
from tests.engine_core.tiny_models import PagedBatch, run_step, write_tiny_model

ATOL = 1e-4
WINDOW = 8
VOCAB = 256
_ROPE_FACTORS = dict(short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
FAMILIES = {
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW, head_dim=16),
    "gemma2": dict(
        model_type="gemma2", head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
    ),
    "gemma3": dict(
        model_type="gemma3", head_dim=16, sliding_window=WINDOW, num_layers=3, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "phi3": dict(
        model_type="phi3", sliding_window=WINDOW, original_max_position_embeddings=64, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **_ROPE_FACTORS},
    ),
}
BACKENDS = [  # (attention backend, enforce_eager)
    pytest.param("torch", True, id="torch-eager"),
    pytest.param("cpp", False, id="cpp-fused", marks=pytest.mark.skipif(
        cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")),
    pytest.param("triton", False, id="triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on the GPU here, not in its CPU interpreter")),
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint folder, transformers reference) of one family."""
    import transformers

    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), vocab_size=VOCAB, **FAMILIES[request.param])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.generation_config.eos_token_id = None  # compare fixed-length greedy continuations
    return folder, ref.eval()


def prompts(lengths: list[int], shared: int = 0, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, VOCAB, (shared,), generator=g).tolist()
    return [prefix + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("backend, eager", BACKENDS)
def test_logits_of_chunked_ragged_batches(family, backend, eager):
    folder, ref = family
    model, config = load_model(str(folder), torch.float32, torch.device("cpu"), select_backend("cpu", backend))
    assert config.sliding_window in (None, WINDOW) and (config.sliding_window is None) == (config.name == "qwen3")
    seqs = prompts([23, 5, 30])
    batch = PagedBatch(config, len(seqs), 40)
    # step 1: two whole prompts and a first chunk; step 2: two decodes, then the rest of the chunked one
    first = [(0, seqs[0]), (1, seqs[1]), (2, seqs[2][:11])]
    run_step(model, batch, first)
    seqs[0].append(7)
    seqs[1].append(9)
    second = [(0, seqs[0][-1:]), (1, seqs[1][-1:]), (2, seqs[2][11:])]
    for (req, tokens), logits in zip(second, run_step(model, batch, second)):
        with torch.no_grad():
            expected = ref(torch.tensor([seqs[req]])).logits[0, -len(tokens):].float()
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend, eager", BACKENDS)
def test_greedy_generation_matches_transformers(family, backend, eager):
    folder, ref = family
    config = EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),  # prompts are prefilled in chunks
        device=DeviceConfig(device="cpu", attention_backend=backend, enforce_eager=eager),
    )
    engine = LLMEngine(config)
    batch = prompts([3, 9]) + prompts([2, 14], shared=12, seed=1)  # the last two share 3 blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = engine.generate(batch, params)
    assert max(o.usage.cached_tokens for o in outputs) >= 12, "the shared prefix was never a cache hit"
    for prompt, output in zip(batch, outputs):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        completion = output.completions[0]
        assert completion.token_ids == out.sequences[0, len(prompt):].tolist(), f"{len(prompt)}-token prompt"
        for ours, step in zip(completion.logprobs, out.logits):
            expected = torch.log_softmax(step[0].float(), -1)[ours.token_ids[0]].item()
            assert abs(ours.logprobs[0] - expected) < ATOL


def test_sliding_window_models_free_the_blocks_behind_the_window(tmp_path):
    """Mistral (every layer sliding): a 70-token request never holds more than the window plus
    one chunk of blocks, and still matches transformers; Gemma 2 (full layers too) keeps all."""
    import transformers

    for name, bounded in (("mistral", True), ("gemma2", False)):
        folder = write_tiny_model(tmp_path / name, vocab_size=VOCAB, **FAMILIES[name])
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=128),
            scheduler=SchedulerConfig(max_num_batched_tokens=16), device=DeviceConfig(device="cpu"),
        ))
        core, (prompt,) = engine.engine_core, prompts([30], seed=5)
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                       output_kind=OutputKind.DELTA))
        held, tokens = [], []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.completions[0].token_ids  # DELTA: this step's new tokens
            held.append(core.info.num_blocks - 1 - core.scheduler.kv_cache_manager.num_free_blocks)
        assert (max(held) <= (WINDOW + 16) // 4 + 2) == bounded, held
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="eager")
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                                    eos_token_id=None, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert list(tokens) == expected[0, len(prompt):].tolist()


def test_longrope_cache_uses_transformers_short_and_long_frequencies():
    """Within the original context our Phi-3 rope equals transformers' short-factor one; past it, the
    long-factor one (transformers switches a whole sequence past the original context to the long
    factors; we choose per position, as vLLM does). Both scaled by the same attention factor."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine_core.models.layers import RotaryEmbedding

    options = FAMILIES["phi3"]
    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                     original_max_position_embeddings=64, rope_parameters=options["rope_parameters"])
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=65)
    scaling = {**options["rope_parameters"], "original_max_position_embeddings": 64, "max_position_embeddings": 256}
    rope = RotaryEmbedding(16, 256, 10000.0, scaling)
    positions = torch.tensor([0, 5, 63, 64, 200])
    cos, sin = rope(positions, torch.float32)
    inv_freq = torch.stack([short if p < 64 else long for p in positions.tolist()])  # [5, 8]
    angles = positions[:, None].float() * inv_freq
    torch.testing.assert_close(cos[:, 0], angles.cos() * factor)
    torch.testing.assert_close(sin[:, 0], angles.sin() * factor)
    assert factor > 1.0
