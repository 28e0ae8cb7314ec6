"""A model's text, torch-free, for both the frontend and the engine: the tokenizer (from a tokenizer.json or
GGUF metadata), the incremental detokenizer with stop strings, the chat-template renderer, and the GGUF header
reader they and the engine's loader read from. The frontend imports this package and engine_core.protocol, nothing
else of engine_core (tests/test_layering.py checks it).
"""
