"""A PEFT LoRA adapter read from its folder: adapter_config.json + adapter_model.safetensors.

Read on the host in fp32 and checked against the model before it is used: its rank against
`max_lora_rank`, its modules against those the model has (engine_core/lora/targets.py), and the
PEFT options Tandem does not run (DoRA, trained biases, whole modules saved beside the adapter)
refused by name. Each module's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA; rank_pattern and
alpha_pattern per module) is folded into its B, so a slot holds what the forward adds.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_core.lora.errors import LoraAdapterError
from engine_core.lora.targets import EMBEDDING_LEAF, LINEAR_LEAVES, LoraTarget

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SAVED_BASE = ".base_layer.weight"
_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


@dataclass
class LoraPiece:
    """One PEFT module's product inside a Tandem module: a [r, in] (for an embedding [r, vocab]),
    b [r, size] with the scaling folded in, landing in rank block `index` and outputs offset..offset+size."""

    index: int
    offset: int
    size: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules'
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # PEFT leaf names it adapts (q_proj, ...), sorted
    modules: dict[str, list[LoraPiece]] = field(default_factory=dict)  # Tandem module path -> its pieces

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for pieces in self.modules.values() for p in pieces)


def load_peft_adapter(name: str, path: str | Path, targets: dict[str, LoraTarget], max_rank: int) -> LoraAdapter:
    """Read and check the adapter in folder `path`; raises LoraAdapterError saying what is wrong."""
    folder = Path(path)
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    use_rslora = bool(config.get("use_rslora", False))
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.endswith(_SAVED_BASE):  # peft saves the base's embeddings beside an adapter of them
            _check_saved_base(name, key, tensor, targets)
            continue
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoraAdapterError(f"{folder / WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight "
                                   "(DoRA magnitudes and saved modules are not supported)")
        module = key[: -len(suffix)].removeprefix(_PREFIX)
        by_module.setdefault(module, {})[suffix.rsplit(".", 1)[-1] if "embedding" in suffix else suffix[6]] = tensor
    unknown = sorted({m.rsplit(".", 1)[-1] for m in by_module} - set(LINEAR_LEAVES) - {EMBEDDING_LEAF})
    if unknown:
        raise LoraAdapterError(f"adapter {name!r} targets modules the model does not have: {', '.join(unknown)} "
                               f"(supported: {', '.join((*LINEAR_LEAVES, EMBEDDING_LEAF))})")
    missing = sorted(m for m in by_module if m not in targets)
    if missing:
        raise LoraAdapterError(f"adapter {name!r} targets modules the model does not have: "
                               f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    adapter = LoraAdapter(name, str(folder), 0, alpha, use_rslora,
                          tuple(sorted({m.rsplit(".", 1)[-1] for m in by_module})))
    for module, weights in sorted(by_module.items()):
        adapter.modules.setdefault(targets[module].path, []).append(
            _piece(name, module, weights, targets[module], config, max_rank))
        adapter.rank = max(adapter.rank, adapter.modules[targets[module].path][-1].a.shape[0])
    if not adapter.modules:
        raise LoraAdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    return adapter


def _check_saved_base(name: str, key: str, tensor: torch.Tensor, targets: dict[str, LoraTarget]) -> None:
    """The embeddings or LM head saved whole by peft (`save_embedding_layers`) are the base's own unless
    the vocabulary was resized, which Tandem does not serve: refuse a shape the model does not have."""
    module = key[: -len(_SAVED_BASE)].removeprefix(_PREFIX)
    leaf = module.rsplit(".", 1)[-1]
    target = targets.get(module) or (targets.get("model.embed_tokens") if leaf == "lm_head" else None)
    if leaf not in ("embed_tokens", "lm_head") or target is None:
        raise LoraAdapterError(f"adapter {name!r} saves module {module} whole (modules_to_save): not served")
    vocab = target.in_features if target.kind == "embedding" else target.out_features
    if tensor.shape[0] != vocab:
        raise LoraAdapterError(f"adapter {name!r} resizes the vocabulary ({module}: {tensor.shape[0]} rows, the "
                               f"model has {vocab}): adapters with new tokens are not served")


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise LoraAdapterError(f"LoRA adapter folder {folder} does not exist (give a PEFT adapter folder)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder") from None
    except json.JSONDecodeError as error:
        raise LoraAdapterError(f"{folder / CONFIG_FILE} is not valid JSON: {error}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    refusals = {
        peft_type != "LORA": f"peft_type {config.get('peft_type')!r} (only LORA is served)",
        bool(config.get("use_dora")): "use_dora (DoRA adapters are not served)",
        config.get("bias", "none") != "none": f"bias={config.get('bias')!r} (trained biases are not served)",
        bool(config.get("modules_to_save")): "modules_to_save (whole saved modules are not served)",
        bool(config.get("fan_in_fan_out")): "fan_in_fan_out (Conv1D models are not served)",
    }
    if any(refusals):
        raise LoraAdapterError(f"{folder / CONFIG_FILE}: {refusals[True]}")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise LoraAdapterError(f"{folder} has no {WEIGHTS_FILE} (PEFT's safetensors weights)")
    try:
        return {key: tensor.float() for key, tensor in load_file(file).items()}
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise LoraAdapterError(f"{file} cannot be read: {error}") from None


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _piece(name: str, module: str, weights: dict[str, torch.Tensor], target: LoraTarget, config: dict,
           max_rank: int) -> LoraPiece:
    leaf = module.rsplit(".", 1)[-1]
    spec = target.pieces[leaf]
    if set(weights) != {"A", "B"} and set(weights) != {"lora_embedding_A", "lora_embedding_B"}:
        raise LoraAdapterError(f"adapter {name!r}: module {module} has {sorted(weights)}, not an A and a B")
    a, b = (weights["A"], weights["B"]) if "A" in weights else (weights["lora_embedding_A"],
                                                                  weights["lora_embedding_B"])
    rank = a.shape[0]
    if rank > max_rank:
        raise LoraAdapterError(f"adapter {name!r} has rank {rank} ({module}), above max_lora_rank {max_rank}: "
                               "start the engine with a larger --max-lora-rank")
    if tuple(a.shape) != (rank, target.in_features) or tuple(b.shape) != (spec.size, rank):
        raise LoraAdapterError(
            f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the model expects "
            f"({rank}, {target.in_features}) and ({spec.size}, {rank}): an adapter for another model?")
    alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraPiece(spec.index, spec.offset, spec.size, a.contiguous(), (b * scaling).t().contiguous())
