"""vLLM's EngineArgs: the engine's options as one flat dataclass, for `LLM(model, **options)` and
`LLMEngine.from_engine_args(EngineArgs(model=...))`; EngineConfig (engine_core/config.py) groups the same
options and more, and is what the engine takes. The names are vLLM's where vLLM has the option."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# vLLM's speculative_config keys -> SpeculativeConfig's fields (the draft model is vLLM's "model")
_SPECULATIVE_KEYS = {"method": "method", "num_speculative_tokens": "num_speculative_tokens",
                     "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
                     "model": "draft_model", "max_batch": "max_batch"}


@dataclass
class EngineArgs:
    model: str | None = None  # a HF folder or a .gguf; None: the embedded SmolLM2
    tokenizer: str | None = None  # None: the model's own
    dtype: str = "auto"
    quantization: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_gib: float = 1.0
    kv_cache_dtype: str = "auto"  # vLLM's name; auto, bf16, fp32, int8, fp8_e4m3 (engine_core/config.py)
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    device: str = "auto"
    enforce_eager: bool = False
    batch_invariant: bool = False  # vLLM: VLLM_BATCH_INVARIANT=1
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # vLLM's: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    speculative_config: dict | None = None

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, quantization=self.quantization, seed=self.seed,
                              max_model_len=self.max_model_len, tokenizer=self.tokenizer),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_gib=self.kv_cache_memory_gib,
                              enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs),
            device=DeviceConfig(device=self.device, enforce_eager=self.enforce_eager,
                                batch_invariant=self.batch_invariant),
            lora=LoraConfig(enable=self.enable_lora, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank),
            speculative=speculative_config(self.speculative_config),
        )


def speculative_config(options: dict | None) -> SpeculativeConfig:
    """SpeculativeConfig from vLLM's speculative_config dict; ValueError names an unknown key."""
    unknown = sorted(set(options or {}) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; the keys: {', '.join(_SPECULATIVE_KEYS)}")
    return SpeculativeConfig(**{_SPECULATIVE_KEYS[key]: value for key, value in (options or {}).items()})
