"""The frontend's tokenizer: engine_core.text.tokenizer, shared with the engine (whose structured-output
masks need the same vocabulary). Torch-free."""

from engine_core.text.tokenizer import TokenizerBundle, load_tokenizer

__all__ = ["TokenizerBundle", "load_tokenizer"]
