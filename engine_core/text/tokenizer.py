"""The model's tokenizer: `tokenizers` built from a HF tokenizer.json or from GGUF metadata.

One loader for both sides: the frontend tokenizes and detokenizes with it, the engine hands its
vocabulary to llguidance for structured-output masks (engine_core/structured/vocabulary.py).
No torch here: the frontend must start fast on a box without a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine_core.text.gguf_metadata import read_gguf_metadata

# llama.cpp's token types (gguf.TokenType): control and user-defined tokens are special
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (as in llama.cpp's llama-vocab)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class TokenizerBundle:
    """A tokenizer plus what the frontend needs around it."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos_id = self.tokenizer.token_to_id(self.bos_token)
            if not ids or ids[0] != bos_id:
                ids = [bos_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path) -> TokenizerBundle:
    """From a .gguf file or a folder holding tokenizer.json (+ tokenizer_config.json)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _from_gguf(path)
    if (path / "tokenizer.json").is_file():
        return _from_hf_folder(path)
    raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a folder with tokenizer.json")


# ---- Hugging Face folder ----------------------------------------------------------
def _from_hf_folder(folder: Path) -> TokenizerBundle:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return TokenizerBundle(
        tokenizer=tokenizer,
        chat_template=_chat_template_from_config(config, folder),
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        add_bos_token=bool(config.get("add_bos_token", False)),
    )


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _chat_template_from_config(config: dict, folder: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return template


# ---- GGUF metadata ----------------------------------------------------------------
def _from_gguf(path: Path) -> TokenizerBundle:
    metadata = read_gguf_metadata(path)
    field = metadata.get
    model_kind = field("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(
            f"{path.name}: tokenizer.ggml.model is {model_kind!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in field("tokenizer.ggml.merges", [])]
    token_types = field("tokenizer.ggml.token_type", [])
    tokenizer = Tokenizer(
        models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, ignore_merges=False)
    )
    tokenizer.pre_tokenizer = _gguf_pre_tokenizer(field("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (_CONTROL, _USER_DEFINED)
    ])
    bos_id, eos_id = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    return TokenizerBundle(
        tokenizer=tokenizer,
        chat_template=field("tokenizer.chat_template"),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
    )


def _gguf_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    pattern = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}.get(pre)
    if pattern is None:  # gpt2 and friends: ByteLevel's own regex
        return byte_level
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
