"""LoRA inside one engine: the model's modules wrapped with slots, the adapters, and each step's rows.

`LoraRuntime.attach(model, ...)` wraps every module of the model that takes an adapter
(engine_core/lora/targets.py: q/k/v/o, gate/up/down, the LM head when untied, the embeddings) once,
at start; the model runner calls `begin_step` with the step's requests in batch order, which
places their adapters in slots (engine_core/lora/manager.py) and tells every wrapped module which
row reads which slot, and `select_head_rows` before each LM-head call.

A step without adapter rows leaves `context.index` None: the wrapped modules add nothing, the CPU's
one-op decoder layers (kernels/cpu/decode_layers.py) and CUDA graphs run as without
LoRA. A step with adapter rows runs the CPU's one-op layers with the adapters' products inside them
(given the layers' slots here), and on CUDA the layers module by module and eagerly (both read
`context.active`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine_core.config import LoraConfig
from engine_core.lora.layers import LoraContext, LoraEmbedding, LoraLinear, LoraSlots
from engine_core.lora.manager import LoraManager
from engine_core.lora.targets import lora_targets
from engine_core.models.llama import op_linears
from engine_core.protocol import LoraInfo
from kernels import LoraStepIndex, select_lora_ops


def _slots_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if not isinstance(module, LoraLinear):
        return None
    return module.slots.lora_a, module.slots.lora_b, module.slots.lora_pieces


class LoraRuntime:
    def __init__(self, manager: LoraManager, context: LoraContext, device: torch.device, dtype: torch.dtype) -> None:
        self.manager = manager
        self.context = context
        self.device = device
        self.dtype = dtype

    @classmethod
    def attach(cls, model: nn.Module, config: LoraConfig, device: torch.device, dtype: torch.dtype,
               attention_backend: str = "auto") -> "LoraRuntime":
        """Wrap the model's adaptable modules with `config.max_loras` slots each and load `config.adapters`."""
        ops = select_lora_ops(device.type, config.max_loras, dtype, config.kernel, attention_backend)
        context = LoraContext(ops)
        targets = lora_targets(model)
        slots: dict[str, LoraSlots] = {}
        for target in {t.path: t for t in targets.values()}.values():
            module_slots = LoraSlots(target, config.max_loras, config.max_lora_rank, device, ops.slot_dtype)
            parent_name, _, child_name = target.path.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            base = getattr(parent, child_name)
            if target.kind == "embedding":
                wrapped = LoraEmbedding(base, module_slots, context)
            else:
                rank = config.max_lora_rank * target.num_pieces
                plan = ops.plan_for(target.in_features, target.out_features, rank)
                wrapped = LoraLinear(base, module_slots, context, plan, head=target.path == "lm_head")
            setattr(parent, child_name, wrapped)
            slots[target.path] = module_slots
        model.model.lora = context  # the decoder asks whether this step has adapters
        decode_layers = getattr(model.model, "decode_layers", None)
        if decode_layers is not None:  # the CPU's one-op layers add the adapters' products themselves
            decode_layers.attach_lora([[_slots_of(linear) for linear in op_linears(layer)]
                                       for layer in model.model.layers])
        manager = LoraManager(targets, slots, config.max_loras, config.max_lora_rank, config.host_capacity)
        runtime = cls(manager, context, device, ops.slot_dtype)
        for name, path in config.adapters.items():
            manager.add(name, path)
        return runtime

    @property
    def active(self) -> bool:
        return self.context.active

    # ---- one step -------------------------------------------------------------------
    def begin_step(self, lora_names: Sequence[str | None], row_counts: Sequence[int]) -> None:
        """The step's requests in batch order: their adapters (None: the base model) and rows."""
        names = {name for name in lora_names if name is not None}
        if not names:
            self.context.index = self.context.head_index = None
            return
        slot_of = self.manager.activate(names)
        row_slots = [slot_of[name] if name is not None else -1
                     for name, count in zip(lora_names, row_counts) for _ in range(count)]
        self.context.index = LoraStepIndex(row_slots, self.manager.max_loras, self.device, self.dtype)
        self.context.head_index = None

    def select_head_rows(self, rows: Sequence[int]) -> None:
        """The step's rows (of `begin_step`'s order) that the next LM-head call computes."""
        index = self.context.index
        self.context.head_index = None if index is None else index.select(list(rows))

    # ---- adapters ---------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoraInfo:
        return self.manager.add(name, path)

    def remove(self, name: str) -> None:
        self.manager.remove(name)

    def pin(self, name: str, pinned: bool = True) -> LoraInfo:
        return self.manager.pin(name, pinned)

    def list(self) -> list[LoraInfo]:
        return self.manager.list()

    def __contains__(self, name: str) -> bool:
        return name in self.manager
