"""What LoRA calls raise, so each transport can answer with its own status (gRPC: see services/)."""

from __future__ import annotations


class LoraAdapterError(ValueError):
    """The adapter cannot be served: not a PEFT LoRA folder, a rank above max_lora_rank, modules the
    model does not have (INVALID_ARGUMENT)."""


class UnknownLoraError(ValueError):
    """No adapter of that name is loaded (NOT_FOUND)."""


class LoraInUseError(ValueError):
    """An adapter with requests in flight cannot be unloaded (FAILED_PRECONDITION)."""


class LoraDisabledError(ValueError):
    """The engine was started without LoRA (FAILED_PRECONDITION)."""
