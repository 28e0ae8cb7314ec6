"""llguidance's tokenizer, built once per engine from the model's own tokenizer data; torch-free.

The masks need every token's bytes: llguidance reads them from the `tokenizers` JSON of the
model's tokenizer (a tokenizer.json, or the one engine_core.text.tokenizer builds from GGUF metadata),
sized to the model's logits so padded ids are simply never allowed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from llguidance import LLTokenizer

from engine_core.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def build_vocabulary(tokenizer_path: str | Path, *, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """LLTokenizer over `vocab_size` ids (the logits' width) with the engine's EOS ids.

    ValueError when the tokenizer is missing or has more tokens than the model has logits.
    """
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(tokenizer_path).tokenizer
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"structured output needs the model's tokenizer: {e}; start the engine with "
                         "--tokenizer pointing at a tokenizer.json folder or a .gguf") from None
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if num_tokens > vocab_size:
        raise ValueError(f"the tokenizer at {tokenizer_path} has {num_tokens} tokens but the model only "
                         f"{vocab_size} logits: it is not this model's tokenizer")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    vocabulary = LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
    logger.info("structured output: vocabulary of %d tokens from %s in %.2f s", num_tokens, tokenizer_path,
                time.perf_counter() - started)
    return vocabulary
