"""The frontend's detokenizer: engine_core.text.detokenizer, shared with the offline LLMEngine (which
detokenizes as vLLM's does). Torch-free."""

from engine_core.text.detokenizer import Detokenizer, decode_logprobs, find_stop

__all__ = ["Detokenizer", "decode_logprobs", "find_stop"]
