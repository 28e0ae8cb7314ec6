"""The KV cache's element types (`--kv-cache-dtype`) and the block layout every attention backend reads.

Each layer has a key cache and a value cache, each [num_blocks, num_kv_heads, block_size, row]: one
(block, kv head) is a contiguous slab of block_size * row elements.

- Float caches (fp32, bf16, fp16): the slab is block_size rows, one per token, of head_dim values.
- 8-bit caches (int8; fp8_e4m3 on CUDA GPUs with fp8): row = head_dim + SCALE_BYTES, and the slab's
  block_size * (head_dim + 2) bytes are the block's codes, then its block_size scales (fp16, one per token):
  value = code * scale. The codes are laid out the way vpdpbusd (AVX-512 VNNI) multiplies four bytes per
  32-bit lane, so the CPU kernel reads them with no shuffles:
    keys    [head_dim / 4][block_size][4]: dims 4j..4j+3 of 16 consecutive tokens are one 64-byte vector,
            16 scores at once (`slab_offsets("key", ...)`);
    values  [block_size / 4][head_dim][4]: 4 consecutive tokens of dim d share a 32-bit lane, and 16 dims
            are one vector, acc[d] += w . v over 4 tokens at once (`slab_offsets("value", ...)`).
  Hence block_size must be a multiple of 16 and head_dim of 4.
  Before quantizing, each token's row is rotated by a Hadamard transform (`hadamard_matrix`: +-1 entries,
  block-diagonal over head_dim's powers of two, computed in float64 and rounded once to fp32): it spreads a
  key's outlier channels over every dim, so one scale per row rounds the others less. Scores and outputs do
  not change in exact arithmetic (H H = n I per block): attention rotates the query the same way and divides
  by n, and rotates its output back (`rotate_back`). What the codes hold is `quantize_kv_rows`' definition.
  One scale per token and kv head: a token's
  codes are written once and never rewritten, so a block's bytes do not depend on which tokens were written
  beside them (batches, chunked-prefill splits and prefix-cache hits give the same codes; a scale per block
  would have to requantize older tokens as new ones arrive). int8: scale = max |x| / 127 rounded to fp16,
  code = x / scale rounded half to even; fp8_e4m3: scale = max |x| / 448, code = x / scale rounded to e4m3 by
  the conversion. `kernels.reference.quantize_kv_rows` is the definition, and every backend's KV write gives
  its codes (tests/kernels).

Bytes per token and layer: 2 * num_kv_heads * row * element size, so with head_dim 64 an int8 cache holds
128 / 66 times the tokens of a bf16 one in the same memory (head_dim 128: 256 / 130 times), and fp32 half as many.
"""

from __future__ import annotations

import functools

import torch

# --kv-cache-dtype's names (engine_core/config.py names them too, for the torch-free flag parser) -> element type
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
}
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
SCALE_BYTES = 2  # each token's scale, as fp16, after the block's codes
SCALE_DTYPE = torch.float16
BLOCK_MULTIPLE = 16  # an 8-bit cache's block_size: a multiple of this (16 tokens' codes make one key vector)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def row_size(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension: a slab holds block_size times this many elements."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                   dtype: torch.dtype) -> tuple[int, int, int, int]:
    if is_quantized(dtype):
        check_quantized_shape(block_size, head_dim)
    return num_blocks, num_kv_heads, block_size, row_size(head_dim, dtype)


def check_quantized_shape(block_size: int, head_dim: int) -> None:
    """ValueError where an 8-bit cache's layout cannot hold these blocks."""
    if block_size % BLOCK_MULTIPLE or head_dim % 4:
        raise ValueError(f"an 8-bit KV cache needs block_size a multiple of {BLOCK_MULTIPLE} and head_dim a "
                         f"multiple of 4 (got block_size {block_size}, head_dim {head_dim}); use block_size 16")


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache.dtype) else cache.shape[-1]


@functools.cache
def slab_offsets(kind: str, block_size: int, head_dim: int) -> torch.Tensor:
    """[block_size, head_dim] int64: where token t's code of dim d lies in an 8-bit slab, for "key" or "value"
    (the module's doc); the token's scale is at byte block_size * head_dim + SCALE_BYTES * t."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    if kind == "key":  # [head_dim / 4][block_size][4]
        return (d // 4) * block_size * 4 + t * 4 + d % 4
    if kind == "value":  # [block_size / 4][head_dim][4]
        return (t // 4) * head_dim * 4 + d * 4 + t % 4
    raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")


def hadamard_blocks(head_dim: int) -> list[int]:
    """The sizes of the rotation's blocks: head_dim's powers of two, largest first (128 -> [128]; 96 -> [64, 32])."""
    return [1 << bit for bit in reversed(range(head_dim.bit_length())) if head_dim >> bit & 1]


@functools.cache
def hadamard_matrix(head_dim: int) -> torch.Tensor:
    """[head_dim, head_dim] float64, Sylvester's Hadamard matrices of `hadamard_blocks` on the diagonal (+-1
    entries, symmetric; H H = n I on a block of n dims)."""
    matrix = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    start = 0
    for size in hadamard_blocks(head_dim):
        block = torch.ones(1, 1, dtype=torch.float64)
        while block.shape[0] < size:
            block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
        matrix[start:start + size, start:start + size] = block
        start += size
    return matrix


@functools.cache
def hadamard_divisors(head_dim: int) -> torch.Tensor:
    """[head_dim] float64: each dim's block size n, what a second rotation divides by to undo the first."""
    return torch.cat([torch.full((size,), float(size), dtype=torch.float64) for size in hadamard_blocks(head_dim)])


def rotate_back(x: torch.Tensor) -> torch.Tensor:
    """[..., D] rotated rows (H x) -> x, in float64 and rounded once to x's dtype: H (H x) / n."""
    head_dim = x.shape[-1]
    matrix = hadamard_matrix(head_dim).to(x.device)
    return ((x.double() @ matrix) / hadamard_divisors(head_dim).to(x.device)).to(x.dtype)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in one layer."""
    return 2 * num_kv_heads * row_size(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-cache-dtype`: auto -> the model's dtype; fp8_e4m3 needs a CUDA GPU with fp8 (compute capability 8.9
    or later). ValueError names the choices."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "fp8_e4m3":
        if device.type != "cuda":
            raise ValueError("kv_cache_dtype fp8_e4m3 runs on CUDA GPUs with fp8 only; use int8 on the CPU")
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8_e4m3 needs compute capability 8.9 or later (Ada, Hopper), this "
                             f"GPU has {capability[0]}.{capability[1]}; use int8")
    return KV_CACHE_DTYPES[name]
