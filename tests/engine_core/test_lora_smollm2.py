"""The embedded SmolLM2 with three random peft adapters and the base model in one batch, fp32: each
request's 64 greedy tokens are those of peft's merge_and_unload copy run alone in transformers (slow).

The reference is transformers' own GGUF path (tests/engine_core/test_loader.py), so both sides hold
the same dequantized weights. SmolLM2 ties its LM head to the embeddings, so the adapters take the
linears (a merged embedding adapter would change the tied head too, which unmerged peft does not).
"""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from engine_core.loader.registry import default_model_path
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from tests.engine_core.test_engine import hf_greedy
from tests.engine_core.test_loader import _transformers_from_gguf

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
LOGPROB_ATOL = 1e-3
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]
ADAPTERS = {
    "attention": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
}


def make_adapter(folder, seed, options):
    """A random non-zero adapter on SmolLM2, saved as a PEFT folder; returns the merged reference model."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(_transformers_from_gguf(default_model_path()).float(),
                                peft.LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3 / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    merged = model.merge_and_unload().eval()
    merged.generation_config.eos_token_id = None
    return merged


def test_smollm2_mixed_batch_matches_merged_adapters(tmp_path):
    folders, references = {}, {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        folders[name] = tmp_path / name
        references[name] = make_adapter(folders[name], seed, options)
    references[None] = _transformers_from_gguf(default_model_path()).float()
    references[None].generation_config.eos_token_id = None
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=512),
        cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        device=DeviceConfig(device="cpu"),
        lora=LoraConfig(max_loras=4, adapters={name: str(folder) for name, folder in folders.items()}),
    ))
    names = [None, *ADAPTERS]
    prompts = [PROMPT[: 13 + 2 * i] for i in range(len(names))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outputs = engine.generate(prompts, params, lora_names=names)
    answers = set()
    for name, prompt, output in zip(names, prompts, outputs):
        completion = output.completions[0]
        ref_tokens, ref_logprobs = hf_greedy(references[name], prompt, MAX_TOKENS)
        assert completion.token_ids == ref_tokens, name
        for step, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
            diff = (torch.tensor(ours.logprobs) - ref[torch.tensor(ours.token_ids)]).abs().max().item()
            assert diff < LOGPROB_ATOL, f"{name or 'base'} step {step}: logprob diff {diff:.2e}"
        answers.add(tuple(completion.token_ids[:16]))
    assert len(answers) == len(names), "every adapter changes SmolLM2's answer"
