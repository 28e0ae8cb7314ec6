"""Checkpoint loading: Hugging Face folders (safetensors) and GGUF files."""

from engine_core.loader.registry import default_model_path, load_model

__all__ = ["default_model_path", "load_model"]
