"""Model implementations."""

from engine_core.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
