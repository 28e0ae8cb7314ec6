"""The frontend's tokenizer as a ZIP of Hugging Face files, for a gateway that tokenizes itself (GetTokenizer).

Built from what the frontend already loaded, never from files on disk: a GGUF's tokenizer and chat
template live in its metadata, and the template a gateway renders must be the one this frontend
renders with. The archive holds `tokenizer.json` (the `tokenizers` object as JSON),
`tokenizer_config.json` (the chat template and special tokens), `config.json` and
`generation_config.json` (EOS and BOS ids, context length), the files smg's tokenizer loader reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass

from engine_core.protocol import EngineInfo
from services.frontend.tokenizer import TokenizerBundle

CHUNK_BYTES = 64 * 1024  # what smg's servicers stream per GetTokenizerChunk


@dataclass(frozen=True)
class TokenizerArchive:
    data: bytes  # the ZIP
    sha256: str  # hex digest of `data`

    def chunks(self, size: int = CHUNK_BYTES) -> list[bytes]:
        return [self.data[start:start + size] for start in range(0, len(self.data), size)]


def build_tokenizer_archive(tokenizer: TokenizerBundle, info: EngineInfo,
                            chat_template: str | None) -> TokenizerArchive:
    """The ZIP of the four files (fixed timestamps, so the same tokenizer gives the same bytes and digest).
    `chat_template`: the one the frontend renders with (AsyncLLM.chat_template: the model's, a shipped
    tool-aware one or --chat-template), not necessarily the tokenizer's own."""
    eos_ids = list(info.eos_token_ids)
    bos_id = tokenizer.tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "model_max_length": info.max_model_len,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    ids = {"eos_token_id": eos_ids, **({"bos_token_id": bos_id} if bos_id is not None else {})}
    files = {
        "tokenizer.json": tokenizer.tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
        "config.json": json.dumps({"vocab_size": info.vocab_size, "max_position_embeddings": info.max_model_len,
                                   **ids}, indent=2),
        "generation_config.json": json.dumps(ids, indent=2),
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
    data = buffer.getvalue()
    return TokenizerArchive(data, hashlib.sha256(data).hexdigest())
