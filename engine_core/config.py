"""Engine configuration as dataclasses, validated on construction.

`EngineConfig` groups what the user chooses (model, cache, scheduler, device);
`ModelArchConfig` is what the loader reads from the checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_QUANTIZATIONS = ("auto", "int8", "int4", "none")
_DEVICES = ("auto", "cpu", "cuda")
_ATTENTION_BACKENDS = ("auto", "torch", "cpp", "triton")
_POLICIES = ("fcfs", "priority")
# kernels/lora_ops.py's choices, named here for the torch-free flag parser (tests/engine_core/test_lora.py checks)
LORA_KERNELS = ("auto", "triton", "per_slot", "segments", "gather_bmm", "stacked", "cpp")
_OVERLAP = ("auto", "on", "off")
SPECULATIVE_METHODS = ("ngram", "draft")
# kernels/kv_cache_layout.py's KV_CACHE_DTYPES and "auto", named here for the torch-free flag parser
# (tests/kernels/test_kv_cache_dtypes.py checks)
KV_CACHE_DTYPES = ("auto", "bf16", "fp32", "int8", "fp8_e4m3")
# kernels/cpu/linear.py's KERNELS and BUCKETS, named here for the torch-free flag parser
# (tests/kernels/test_linear_pins.py checks)
LINEAR_KERNELS = ("linear", "linear_colmajor", "linear_rowwise", "int8_weight_only", "int8_dynamic", "int8_gemv",
                  "int8_vnni", "int8_grouped", "int8_blockwise", "linear_onednn", "linear_bf16_packed", "int4",
                  "int4_gemv")
LINEAR_BUCKETS = (1, 8, 32, 128, 512)

# a linear's attribute name (or "*": every linear) -> {bucket: kernel}, bucket None: every bucket the layer has
LinearPins = dict[str, dict[int | None, str]]


def parse_linear_kernels(spec: str | None) -> LinearPins:
    """`--linear-kernels` SPEC -> {layer: {bucket: kernel}}: comma-separated LAYER[@ROWS]=KERNEL, LAYER a
    linear's attribute name in the model (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head, ...) or `*`,
    ROWS one of LINEAR_BUCKETS (absent: every bucket the layer has; the LM head's stop at 128). A later item
    overrides an earlier one for the same layer and bucket, an item for one bucket one for every bucket, and a
    layer's own items `*`'s (kernels/cpu/linear.py). ValueError names the choices."""
    pins: LinearPins = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        target, sep, kernel = item.partition("=")
        layer, at, rows = target.strip().partition("@")
        layer, kernel = layer.strip(), kernel.strip()
        _require(bool(sep and layer and kernel),
                 f"linear kernels: expected LAYER[@ROWS]=KERNEL (e.g. down_proj=int8_gemv or *@512=linear_onednn), "
                 f"got {item!r}")
        _require(kernel in LINEAR_KERNELS,
                 f"linear kernels: unknown kernel {kernel!r} in {item!r}; the kernels: {', '.join(LINEAR_KERNELS)}")
        if at:
            _require(rows.strip().isdigit() and int(rows) in LINEAR_BUCKETS,
                     f"linear kernels: rows {rows.strip()!r} in {item!r} is not a bucket; the buckets: "
                     f"{', '.join(map(str, LINEAR_BUCKETS))}")
        if at:
            pins.setdefault(layer, {})[int(rows)] = kernel
        else:
            pins[layer] = {None: kernel}  # over the layer's earlier items
    return pins


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2
    dtype: str = "auto"  # auto: on CPU the faster of bf16 / fp32 measured at load; bf16 on CUDA
    # CPU linear layers, each batch bucket taking the kernel measured fastest at load. none: float
    # weights; int8: int8 weight-only or W8A8 (activations rounded to 8 bits, lossy);
    # int4: GGUF-style 4-bit groups of 32 (lossy on float checkpoints); auto: the kernels within each
    # layer's accuracy budget (kernels/cpu/accuracy_budget.py: float, int4 where it holds the weights
    # exactly as in a Q4_0/Q4_1 GGUF), and none when dtype is float32 (the exact path)
    quantization: str = "auto"
    # Pins CPU linear kernels instead of timing them: "LAYER[@ROWS]=KERNEL,..." (parse_linear_kernels). A
    # pinned layer and bucket is never timed nor cached, and overrides `quantization`; None: every kernel timed
    linear_kernels: str | None = None
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    # The tokenizer whose vocabulary structured-output masks use: a .gguf or a folder with
    # tokenizer.json. None: the model's own (its .gguf, or tokenizer.json beside its weights).
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.quantization in _QUANTIZATIONS,
                 f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        parse_linear_kernels(self.linear_kernels)  # validates the spec's syntax and names
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1 (or unset to use the model's), got {self.max_model_len}",
        )


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    # The KV cache's element type (kernels/kv_cache_layout.py): auto = the model's dtype; int8 (and fp8_e4m3 on
    # CUDA GPUs with fp8) stores codes and a scale per token and kv head, about half of bf16's bytes, so the
    # same kv_cache_memory_gib holds about twice the blocks (docs/kv-cache-dtype.md)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.kv_cache_dtype not in ("int8", "fp8_e4m3") or self.block_size % 16 == 0,
                 f"kv_cache_dtype {self.kv_cache_dtype} needs block_size a multiple of 16 (its blocks hold 16 "
                 f"tokens' codes per vector), got {self.block_size}")
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two in [1, 128], got {self.block_size}",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 2,
            f"num_blocks must be >= 2 (one is the reserved null block), got {self.num_blocks}",
        )
        _require(
            self.kv_cache_memory_gib > 0,
            f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}",
        )


# The token budget of one step when none is given, by device. On a CPU a long step holds every running
# stream's next token, and a burst's later prompts their first, for its whole length, while 512-token chunks
# run the linears about as efficiently as longer ones (the plans' 512-row bucket stands for them): the
# measurements are in docs/cpu-tuning.md#step-budget.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass
class SchedulerConfig:
    # prompt tokens one step computes (its running decodes ride on top, engine_core/scheduling/scheduler.py); None:
    # DEFAULT_MAX_NUM_BATCHED_TOKENS for the device (and without chunked prefill at least max_model_len),
    # resolved by the engine core
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128  # most requests running at once
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.policy in _POLICIES, f"policy must be one of {_POLICIES}, got {self.policy!r}")


@dataclass
class DeviceConfig:
    device: str = "auto"  # auto: cuda when available, else cpu
    attention_backend: str = "auto"  # auto: triton on cuda, cpp on cpu (torch when no C++ compiler)
    num_threads: int | None = None  # torch CPU threads; None: leave torch's default
    # True: no CUDA graphs and no fused layer ops (C++ / Triton), every layer runs plain torch ops (vLLM's flag)
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int = 256  # largest decode batch captured (also capped by max_num_seqs)
    # Overlapped steps (engine_core/overlap.py): schedule and prepare the next step while this one runs.
    # auto: on for CUDA, off on CPU (docs/gpu.md has the measurements)
    overlap: str = "auto"
    # Batch-invariant kernels (vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic inference): a request's
    # greedy tokens and logprobs are the same alone or in any batch, with its prefix cached or not, across
    # chunked-prefill splits. Linears run one fixed-order kernel at every batch size, attention never splits
    # a context across threads, no one-op decode layers (docs/batch-invariance.md has the cost)
    batch_invariant: bool = False
    # Before the engine's owner says it serves, run dummy requests at every shape a step meets, so that no kernel
    # compiles after ready (engine_core/readiness/warm_up.py); False: start faster, compile on the first requests
    warm_up: bool = True

    def __post_init__(self) -> None:
        _require(self.device in _DEVICES, f"device must be one of {_DEVICES}, got {self.device!r}")
        _require(
            self.attention_backend in _ATTENTION_BACKENDS,
            f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _require(
            self.num_threads is None or self.num_threads >= 1,
            f"num_threads must be >= 1, got {self.num_threads}",
        )
        _require(self.overlap in _OVERLAP, f"overlap must be one of {_OVERLAP}, got {self.overlap!r}")
        _require(
            self.cuda_graph_max_batch_size >= 1,
            f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}",
        )


@dataclass
class LoraConfig:
    """Serving LoRA adapters beside the base model (docs/lora.md). Off unless `enable`."""

    enable: bool = False
    max_loras: int = 4  # device slots: the most distinct adapters in one step
    max_lora_rank: int = 16  # adapters of a higher rank are refused; slots are this wide
    max_cpu_loras: int | None = None  # adapters kept in host memory (LRU, pinned ones stay); None: max_loras
    kernel: str = "auto"  # auto: Triton on CUDA, the fastest measured on CPU; or one kernel (kernels/lora_ops.py)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT folder, loaded at start
    # steps a waiting request may be passed over for others' adapters before it holds the queue
    max_wait_steps: int = 32

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        _require(self.max_wait_steps >= 0, f"max_wait_steps must be >= 0, got {self.max_wait_steps}")
        _require(self.kernel in LORA_KERNELS, f"lora kernel must be one of {LORA_KERNELS}, got {self.kernel!r}")
        if self.adapters:
            self.enable = True

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


# The most running requests a step speculates for, by device, when SpeculativeConfig.max_batch is unset: above it
# the step verifies no drafts. On a CPU one stream's decode is bound by reading the weights, so k more rows cost
# little; a full batch is bound by its arithmetic, and k more rows per request cost about k times the step.
# scripts/bench_spec_decode.py measures the crossover on a machine (docs/speculative-decoding.md).
DEFAULT_SPECULATIVE_MAX_BATCH = {"cpu": 4, "cuda": 32}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (docs/speculative-decoding.md): a proposer guesses the next tokens, the model verifies
    them in one forward and keeps the longest prefix its own sampling agrees with. Off unless `method` is set."""

    method: str | None = None  # ngram: prompt lookup in the request's own tokens; draft: a smaller model
    num_speculative_tokens: int = 4  # k: tokens proposed per request and step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix of the tokens matched earlier in them
    prompt_lookup_max: int = 5  # ngram: the longest
    draft_model: str | None = None  # draft: the smaller model (same tokenizer), a HF folder or a .gguf
    # most running requests a step speculates for; None: DEFAULT_SPECULATIVE_MAX_BATCH for the device
    max_batch: int | None = None

    def __post_init__(self) -> None:
        _require(self.method is None or self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {SPECULATIVE_METHODS} (or unset: off), got {self.method!r}")
        _require(self.num_speculative_tokens >= 1,
                 f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"prompt lookup lengths need 1 <= min <= max, got min {self.prompt_lookup_min}, "
                 f"max {self.prompt_lookup_max}")
        _require(self.max_batch is None or self.max_batch >= 0, f"max_batch must be >= 0, got {self.max_batch}")
        _require((self.method == "draft") == (self.draft_model is not None) or self.method is None,
                 "speculative method 'draft' takes a draft_model (and only it does): --draft-model PATH")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass
class EngineConfig:
    # a ModelConfig, or only the model's path (a HF folder or a .gguf, as vLLM's LLM(model=...)), which
    # becomes ModelConfig(model=PATH)
    model: ModelConfig | str | os.PathLike = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if isinstance(self.model, (str, os.PathLike)):
            self.model = ModelConfig(model=os.fspath(self.model))
        _require(isinstance(self.model, ModelConfig),
                 f"model must be a ModelConfig or a model path (str), got {type(self.model).__name__}")


@dataclass
class ModelArchConfig:
    """A decoder's architecture, read from config.json or GGUF metadata.

    `name` is the family (engine_core/models/registry.py); the fields after `name` are the
    few places where the families differ from Llama."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    # per layer "full_attention" | "sliding_attention"; empty: every layer full
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer sees, its own included
    rope_local_theta: float | None = None  # sliding layers' rope base when it differs (Gemma 3)
    qk_norm: bool = False  # RMSNorm per head on q and k before rope (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits (Gemma 2)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def __post_init__(self) -> None:
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        _require(
            not self.layer_types or len(self.layer_types) == self.num_hidden_layers,
            f"layer_types names {len(self.layer_types)} layers, the model has {self.num_hidden_layers}",
        )
