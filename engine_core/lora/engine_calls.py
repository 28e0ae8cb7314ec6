"""EngineCore's LoRA calls (vLLM's add_lora, remove_lora, pin_lora, list_loras), kept beside the rest of LoRA so
the engine's step files stay short. EngineCore inherits them; they read its `lora` (a LoraRuntime, or None when
the engine serves no adapters) and its scheduler's requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.lora.errors import LoraDisabledError, LoraInUseError
from engine_core.protocol import EngineCoreRequest, LoraInfo

if TYPE_CHECKING:
    from engine_core.lora.runtime import LoraRuntime
    from engine_core.scheduling.scheduler import Scheduler


class EngineLoraCalls:
    lora: LoraRuntime | None
    scheduler: Scheduler

    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Load a PEFT adapter folder under `name`; LoraAdapterError says why one cannot be served."""
        return self._require_lora().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter. Refused (LoraInUseError) while requests that use it are in flight: abort them or
        let them finish first."""
        runtime = self._require_lora()
        runtime.manager.info(name)
        in_flight = sum(1 for r in self.scheduler.requests.values() if r.lora_name == name)
        if in_flight:
            raise LoraInUseError(f"LoRA adapter {name!r} has {in_flight} requests in flight: abort them or let "
                                 "them finish before unloading it")
        runtime.remove(name)

    def pin_lora(self, name: str, pinned: bool = True) -> LoraInfo:
        return self._require_lora().pin(name, pinned)

    def list_loras(self) -> list[LoraInfo]:
        return [] if self.lora is None else self.lora.list()

    def validate_lora(self, request: EngineCoreRequest) -> None:
        """UnknownLoraError when its adapter is not loaded; LoraAdapterError when its folder cannot be read."""
        if request.lora_name is not None:
            self._require_lora().manager.prepare(request.lora_name)

    def _require_lora(self) -> LoraRuntime:
        if self.lora is None:
            raise LoraDisabledError("this engine serves no LoRA adapters: start it with --enable-lora "
                                    "(or --lora NAME=PATH)")
        return self.lora
