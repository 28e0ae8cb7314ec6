"""The prefix cache's block hashes: one definition for the engine and the frontend's router.

A full block of `block_size` token ids hashes together with its parent block's hash, so equal
hashes mean equal prefixes (the engine still confirms a hit by comparing the tokens). A LoRA
adapter's requests start their chain from the adapter's name (`root_hash`). The hash is
stable across processes, machines and Python versions (BLAKE2b over little-endian int32 token ids,
not Python's `hash()`, whose value for None changes with every process before Python 3.12): an
engine reports the hashes it holds and a frontend computes the same ones from a prompt.
Torch-free and grpc-free: the frontend imports it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = int  # unsigned 64-bit

_ROOT = bytes(8)  # the parent of a prompt's first block
_PERSON = b"tandem-kv-v1"  # changes when the scheme does, so old and new hashes never meet


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: the parent's hash and the block's token ids."""
    digest = blake2b(_ROOT if parent_hash is None else parent_hash.to_bytes(8, "little"),
                     digest_size=8, person=_PERSON)
    tokens = array("i", token_ids)
    if tokens.itemsize != 4:  # pragma: no cover - every platform Tandem runs on has 4-byte C ints
        raise RuntimeError("array('i') is not 32-bit here")
    if array("i", [1]).tobytes()[0] != 1:  # pragma: no cover - big-endian hosts
        tokens.byteswap()
    digest.update(tokens.tobytes())
    return int.from_bytes(digest.digest(), "little")


def root_hash(lora_name: str | None) -> BlockHash | None:
    """The parent of a prompt's first block: none for the base model, the adapter's name hashed for a
    LoRA adapter's requests, so the same tokens under two adapters (or none) share no block."""
    if lora_name is None:
        return None
    digest = blake2b(lora_name.encode(), digest_size=8, person=_PERSON, salt=b"lora")
    return int.from_bytes(digest.digest(), "little")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, limit: int | None = None,
                       lora_name: str | None = None) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids` (at most `limit` of them) under the
    adapter `lora_name` (None: the base model)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if limit is not None:
        num_blocks = min(num_blocks, limit)
    hashes: list[BlockHash] = []
    parent = root_hash(lora_name)
    for start in range(0, num_blocks * block_size, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
