"""Adapters known to an engine, the ones in host memory, and the ones in the device slots.

Three tiers, as in vLLM (`max_cpu_loras` over `max_loras`):
- registered: every adapter loaded by name (`add`) until `remove`; its folder is remembered;
- host memory: an LRU of up to `max_cpu_loras` adapters read from their folders. An adapter pushed
  out is read again from its folder when a request needs it (the step that needs it waits for the
  read). Pinned adapters are never pushed out; when every adapter in host memory is pinned,
  another cannot be loaded;
- device slots: `max_loras` slots in every adapted module; `activate` gives each adapter of a step
  a slot, taking the least recently used slot whose adapter the step does not use (unpinned ones
  first). The scheduler never puts more than `max_loras` adapters in one step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine_core.lora.adapter import LoraAdapter, load_peft_adapter
from engine_core.lora.errors import LoraAdapterError, UnknownLoraError
from engine_core.lora.layers import LoraSlots
from engine_core.lora.targets import LoraTarget
from engine_core.protocol import LoraInfo

logger = logging.getLogger(__name__)


@dataclass
class _Registered:
    name: str
    path: str
    lora_id: int
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    pinned: bool = False


class LoraManager:
    def __init__(self, targets: dict[str, LoraTarget], slots: dict[str, LoraSlots], max_loras: int, max_rank: int,
                 host_capacity: int) -> None:
        self.targets = targets
        self.slots = slots  # Tandem module path -> its slots
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.host_capacity = host_capacity
        self.registered: dict[str, _Registered] = {}
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.slot_names: list[str | None] = [None] * max_loras
        self._slot_used: list[float] = [0.0] * max_loras
        self._next_id = 1

    # ---- registry ------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoraInfo:
        """Read, check and register an adapter. Re-adding a name with the same folder is a no-op;
        another folder under a loaded name is refused (remove it first)."""
        if not name:
            raise LoraAdapterError("an adapter needs a name")
        known = self.registered.get(name)
        if known is not None:
            if known.path != str(path):
                raise LoraAdapterError(f"adapter {name!r} is already loaded from {known.path}; remove it first")
            return self.info(name)
        adapter = load_peft_adapter(name, path, self.targets, self.max_rank)
        self._make_host_room()
        self.registered[name] = _Registered(name, adapter.path, self._next_id, adapter.rank, adapter.alpha,
                                            adapter.target_modules)
        self._next_id += 1
        self.host[name] = adapter
        logger.info("LoRA adapter %s loaded from %s: rank %d, %s, %.1f MiB", name, adapter.path, adapter.rank,
                    ",".join(adapter.target_modules), adapter.nbytes / 2**20)
        return self.info(name)

    def remove(self, name: str) -> None:
        self._require(name)
        del self.registered[name]
        self.host.pop(name, None)
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            self.slot_names[slot] = None
            for module_slots in self.slots.values():
                module_slots.write(slot, [])

    def pin(self, name: str, pinned: bool = True) -> LoraInfo:
        """Keep the adapter in host memory (read back first if it was pushed out)."""
        self._require(name)
        if pinned and name not in self.host:
            self._make_host_room()
            self._host_adapter(name)
        self.registered[name].pinned = pinned
        return self.info(name)

    def info(self, name: str) -> LoraInfo:
        entry = self._require(name)
        location = "device" if name in self.slot_names else "host" if name in self.host else "disk"
        return LoraInfo(entry.name, entry.path, entry.rank, entry.alpha, entry.target_modules, entry.pinned, location,
                        entry.lora_id)

    def list(self) -> list[LoraInfo]:
        return [self.info(name) for name in self.registered]

    def __contains__(self, name: str) -> bool:
        return name in self.registered

    # ---- slots ----------------------------------------------------------------------
    def activate(self, names: set[str]) -> dict[str, int]:
        """A slot for each adapter of this step (at most max_loras), written from host memory where
        it was not there already; returns name -> slot."""
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} adapters in one step, more than max_loras {self.max_loras}")
        now = time.monotonic()
        placed = {}
        for name in sorted(names, key=lambda n: n not in self.slot_names):  # those already in slots first
            if name in self.slot_names:
                slot = self.slot_names.index(name)
            else:
                slot = self._free_slot(names)
                adapter = self._host_adapter(name)
                for path, module_slots in self.slots.items():
                    module_slots.write(slot, adapter.modules.get(path, []))
                self.slot_names[slot] = name
            self._slot_used[slot] = now
            placed[name] = slot
        return placed

    def _free_slot(self, keep: set[str]) -> int:
        """An empty slot, else the least recently used one whose adapter is not in `keep`, unpinned first."""
        if None in self.slot_names:
            return self.slot_names.index(None)
        candidates = [slot for slot, name in enumerate(self.slot_names) if name not in keep]
        return min(candidates, key=lambda slot: (self.registered[self.slot_names[slot]].pinned, self._slot_used[slot]))

    # ---- host memory ----------------------------------------------------------------
    def prepare(self, name: str) -> None:
        """Before a request of `name` is queued: its weights in host memory (read again if they were pushed
        out), so that a folder gone since the load is refused now (LoraAdapterError), not in a step."""
        self._require(name)
        if not (name in self.slot_names or name in self.host):
            self._host_adapter(name)

    def _host_adapter(self, name: str) -> LoraAdapter:
        """The adapter from host memory (marked recently used), read again from its folder if pushed out; when
        every adapter in host memory is pinned, read for this use only."""
        if name in self.host:
            self.host.move_to_end(name)
            return self.host[name]
        adapter = load_peft_adapter(name, self.registered[name].path, self.targets, self.max_rank)
        if self._make_host_room(required=False):
            self.host[name] = adapter
        return adapter

    def _make_host_room(self, required: bool = True) -> bool:
        """Push least recently used unpinned adapters out until one more fits; False (or LoraAdapterError when
        `required`) when every adapter there is pinned."""
        while len(self.host) >= self.host_capacity:
            victim = next((name for name in self.host if not self.registered[name].pinned), None)
            if victim is None:
                if not required:
                    return False
                raise LoraAdapterError(f"host memory holds max_cpu_loras={self.host_capacity} adapters and all are "
                                       "pinned: unpin or remove one, or raise --max-cpu-loras")
            del self.host[victim]
            logger.info("LoRA adapter %s left host memory (read again from %s when used)", victim,
                        self.registered[victim].path)
        return True

    def _require(self, name: str) -> _Registered:
        entry = self.registered.get(name)
        if entry is None:
            loaded = ", ".join(self.registered) or "none"
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return entry
