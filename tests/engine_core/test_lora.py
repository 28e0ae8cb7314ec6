"""LoRA adapters served by the engine: one batch mixing the base model and three adapters gives each
request the greedy tokens of a solo run of peft's `merge_and_unload` copy of its adapter.

The adapters are random and non-zero (tests/engine_core/tiny_lora.py), made with peft on a tiny
random Llama: rank 8 on every linear, the LM head and the embeddings; rank 4 rsLoRA on attention;
rank 16 on the MLP with per-module rank and alpha patterns. Every request shares a 3-block prompt
with the others, so a prefix cache that mixed adapters would change the answers.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from tests.engine_core.test_engine import CPP, CUDA, INTERPRETER, hf_greedy
from tests.engine_core.tiny_lora import ALL_LINEAR, merged_model, write_tiny_adapter
from tests.engine_core.tiny_models import write_tiny_model

BLOCK_SIZE = 4
VOCAB = 256
MAX_TOKENS = 64
LOGPROB_ATOL = 1e-3  # fp32: unmerged (x W + x A B) against merged (x (W + A B)) sums
ADAPTERS = {
    "everything": dict(rank=8, alpha=16, target_modules=ALL_LINEAR + ["lm_head", "embed_tokens"], seed=1),
    "attention": dict(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True,
                      seed=2),
    "mlp": dict(rank=16, alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"], seed=3,
                rank_pattern={"gate_proj": 2}, alpha_pattern={"down_proj": 8}),
}


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """(base folder, {adapter name: folder}, {None or adapter name: its reference transformers model})."""
    base = write_tiny_model(tmp_path_factory.mktemp("tiny-llama-lora"), vocab_size=VOCAB)
    folders = {name: write_tiny_adapter(base, tmp_path_factory.mktemp(name), **options)
               for name, options in ADAPTERS.items()}
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    references = {None: reference, **{name: merged_model(base, folder) for name, folder in folders.items()}}
    return base, folders, references


def lora_config(base, folders, *, backend="torch", kernel="auto", enforce_eager=False, max_loras=4,
                max_cpu_loras=None, budget=16, num_blocks=512, max_num_seqs=32, device="cpu") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(base), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        device=DeviceConfig(device=device, attention_backend=backend, enforce_eager=enforce_eager),
        lora=LoraConfig(enable=True, max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras,
                        kernel=kernel, adapters={name: str(folder) for name, folder in folders.items()}),
    )


def mixed_prompts() -> list[tuple[str | None, list[int]]]:
    """Two prompts per model (the base and each adapter): a shared 13-token one and one of its own."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(4, VOCAB, (3 * BLOCK_SIZE + 1,), generator=g).tolist()
    requests = []
    for i, name in enumerate([None, *ADAPTERS]):
        requests.append((name, shared))
        requests.append((name, torch.randint(4, VOCAB, (2 + 5 * i,), generator=g).tolist()))
    return requests


def assert_matches_merged(engine: LLMEngine, references, max_tokens: int = MAX_TOKENS):
    requests = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outputs = engine.generate([prompt for _, prompt in requests], params, lora_names=[name for name, _ in requests])
    for (name, prompt), output in zip(requests, outputs):
        completion = output.completions[0]
        ref_tokens, ref_logprobs = hf_greedy(references[name], prompt, max_tokens)
        assert completion.token_ids == ref_tokens, f"{name or 'base'}, prompt of {len(prompt)}: greedy tokens differ"
        for step, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
            diff = (torch.tensor(ours.logprobs) - ref[torch.tensor(ours.token_ids)]).abs().max().item()
            assert diff < LOGPROB_ATOL, f"{name or 'base'}, prompt of {len(prompt)}, step {step}: {diff:.2e}"


def test_the_flag_parser_names_the_kernels_there_are():
    from engine_core.config import LORA_KERNELS
    from kernels.lora_ops import LORA_KERNELS as KERNELS

    assert LORA_KERNELS == KERNELS


@pytest.mark.parametrize("kernel", ["per_slot", "segments", "gather_bmm", "stacked", "cpp", "auto"])
def test_mixed_batch_matches_merged_adapters_cpu(lora_models, kernel):
    base, folders, references = lora_models
    engine = LLMEngine(lora_config(base, folders, kernel=kernel))
    assert_matches_merged(engine, references)


@CPP
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["fused", "eager"])
def test_mixed_batch_matches_merged_adapters_cpp_attention(lora_models, enforce_eager):
    base, folders, references = lora_models
    engine = LLMEngine(lora_config(base, folders, backend="cpp", enforce_eager=enforce_eager))
    assert_matches_merged(engine, references)


@INTERPRETER
@pytest.mark.parametrize("max_tokens", [12, pytest.param(MAX_TOKENS, marks=pytest.mark.slow)])
def test_mixed_batch_matches_merged_adapters_triton_interpreter(lora_models, max_tokens):
    """The Triton LoRA kernels in the interpreter, a program per row: 64 tokens take ~100 s on 2 cores,
    so `make test` runs 12 and the slow tier 64. Attention stays on torch (interpreting it as well
    doubled the time; tests/engine_core/test_engine.py covers it)."""
    base, folders, references = lora_models
    engine = LLMEngine(lora_config(base, folders, kernel="triton"))
    assert engine.engine_core.lora.context.ops.kernel == "triton"
    assert_matches_merged(engine, references, max_tokens)


@CUDA
def test_mixed_batch_matches_merged_adapters_cuda(lora_models):
    """The Triton LoRA kernels and paged attention on the GPU, in fp32, against the merged copies on CPU."""
    base, folders, references = lora_models
    engine = LLMEngine(lora_config(base, folders, backend="triton", kernel="triton", device="cuda"))
    assert engine.engine_core.lora.context.ops.kernel == "triton"
    assert_matches_merged(engine, references)


def test_prompt_logprobs_read_the_adapted_lm_head(lora_models):
    """Prompt logprobs run the LM head over a span of rows of their own: it must take their adapter too."""
    base, folders, references = lora_models
    engine = LLMEngine(lora_config(base, folders, kernel="segments"))
    prompt = torch.randint(4, VOCAB, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    names = [None, "everything", "attention"]
    outputs = engine.generate([prompt] * len(names), params, lora_names=names)
    for name, output in zip(names, outputs):
        with torch.no_grad():
            expected = torch.log_softmax(references[name](torch.tensor([prompt])).logits[0].float(), -1)
        ours = torch.tensor([entry.logprobs[0] for entry in output.prompt_logprobs])
        assert [entry.token_ids[0] for entry in output.prompt_logprobs] == prompt[1:]
        reference = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert (ours - reference).abs().max().item() < LOGPROB_ATOL, name


def test_overlapped_steps_keep_each_step_on_its_own_adapter_rows(lora_models):
    """Overlapped steps (engine_core/overlap.py) run step N's sampling on the device queue before step N+1's
    forward places its adapters: the LM head must read step N's rows."""
    base, folders, references = lora_models
    config = lora_config(base, folders, kernel="segments")
    config.device.overlap = "on"
    engine = LLMEngine(config)
    assert engine.engine_core.overlapped is not None
    assert_matches_merged(engine, references, 24)
