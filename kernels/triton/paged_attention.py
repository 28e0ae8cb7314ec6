"""Unified Triton paged attention over one flattened ragged batch.

One launch serves decode tokens and prefill chunks alike (the shape of vLLM's
triton `unified_attention`); its reference is `kernels.reference.paged_attention`:

- grid = (query blocks, kv heads, context splits). A query block holds up to
  BLOCK_Q consecutive tokens of one request times the `num_heads // num_kv_heads`
  query heads that share a kv head, flattened into BLOCK_M rows, so the keys and
  values of a tile are loaded once for the whole GQA group.
- Query blocks are numbered without a host sync: request b owns the blocks from
  `query_start_loc[b] // BLOCK_Q + b` on; a program finds its request by binary
  search over `query_start_loc` and exits if it lands past the request's end.
- Each program walks its context in tiles of TILE_N positions, reading keys and
  values from the paged cache through the block table (a tile may span several
  cache blocks), with the causal mask `key_pos <= query_pos` and the online
  (flash) softmax recurrence in fp32.
- Split context (flash decoding): in a decode-only batch the tiles of one
  (request, kv head) are divided over NUM_SPLITS programs, each writing an
  unnormalised partial (acc, running max, running sum); a small reduce kernel
  combines them. The count is chosen from the device's SM count, the batch, the kv
  heads and the context (`choose_num_splits`), so that a batch of few requests still
  puts several programs on every SM. With NUM_SPLITS == 1 the attention kernel
  writes the output. Prefill and mixed batches never split.
- Per layer, a sliding window W hides keys at or before `query_pos - W` (tiles wholly
  before the block's first window are skipped), and a logit soft-cap c turns each
  scaled score s into c * tanh(s / c) before the mask.
- An 8-bit cache (int8, fp8_e4m3; kernels/kv_cache_layout.py) is read code by code from its
  slab layout and dequantized in registers (code * the token's fp16 scale) before the dots; its rows
  were rotated (H x) when written, so the query is rotated the same way (H q / n) and the output
  back (H acc / n).

Every loop bound comes from device tensors (`seq_lens`, `query_start_loc`), so
the split count and block sizes picked on the host from metadata are performance
choices only: a CUDA graph captured with one choice stays correct on replay.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache_layout import is_quantized

LOG2E = tl.constexpr(1.4426950408889634)
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest b < num_reqs with query_start_loc[b] // BLOCK_Q + b <= q_block (binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _load_codes(key_cache_ptr, value_cache_ptr, slab, t, dims, key_valid, kv_mask, block_size,
                HEAD_DIM: tl.constexpr):
    """A tile's keys and values [TILE_N, DIM_PAD] from an 8-bit cache, in fp32: each token's codes (t: its
    offset in its block, slab: where its block's slab starts) times its scale."""
    key_at = (dims[None, :] // 4) * block_size * 4 + t[:, None] * 4 + dims[None, :] % 4
    value_at = (t[:, None] // 4) * HEAD_DIM * 4 + dims[None, :] * 4 + t[:, None] % 4
    k = tl.load(key_cache_ptr + slab[:, None] + key_at, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(value_cache_ptr + slab[:, None] + value_at, mask=kv_mask, other=0.0).to(tl.float32)
    scale_at = slab + block_size * HEAD_DIM + 2 * t
    k_scale = tl.load((key_cache_ptr + scale_at).to(tl.pointer_type(tl.float16)), mask=key_valid, other=0.0)
    v_scale = tl.load((value_cache_ptr + scale_at).to(tl.pointer_type(tl.float16)), mask=key_valid, other=0.0)
    return k * k_scale.to(tl.float32)[:, None], v * v_scale.to(tl.float32)[:, None]


# per-step integers are not specialized (Triton compiles a variant for values of 1 and multiples of 16): the
# variants warm-up compiles are all a step can meet
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _attention_kernel(
    out_ptr,  # [T, H, D], written when NUM_SPLITS == 1
    part_acc_ptr,  # [T, H, NUM_SPLITS, D] fp32, written when NUM_SPLITS > 1
    part_max_ptr, part_sum_ptr,  # [T, H, NUM_SPLITS] fp32: running max (log2 units) and sum
    query_ptr,  # [T, H, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, Hkv, block_size, D]
    block_tables_ptr,  # [B, max_blocks_per_seq] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    num_reqs,
    num_heads,
    scale,
    window,  # keys a query sees, its own included (2**30: no window)
    softcap,  # used when SOFTCAP
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    block_size,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * QUERIES_PER_KV, padded to a power of two
    TILE_N: tl.constexpr,  # context positions per loop step
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand type of both dots: the query dtype (see the wrapper)
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr,  # an 8-bit cache: codes in its slabs' layout, fp16 scales after them
    DECODE_ONLY: tl.constexpr = False,  # every request has one query token: one program per request and kv head
    rotation_ptr=None,  # QUANTIZED: [DIM_PAD, DIM_PAD] fp32 Hadamard rotation, then [DIM_PAD] 1 / block size
):
    """One (query block, kv head, context split): flash attention over paged K/V."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- which request and which of its tokens this program serves
    if DECODE_ONLY:  # one query token a request: program q_block is request q_block, no search
        req = q_block
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        local_start = 0
    else:
        req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        local_start = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q
        if local_start >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # positions cached before this step's tokens

    # --- rows: BLOCK_Q tokens x QUERIES_PER_KV heads
    rows = tl.arange(0, BLOCK_M)
    local_token = local_start + rows // QUERIES_PER_KV  # [BLOCK_M]
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (local_token < q_len)
    query_pos = context_len + local_token  # [BLOCK_M] absolute positions
    token = q_start + local_token

    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
    )  # [BLOCK_M, DIM_PAD]
    if QUANTIZED:  # the keys were rotated when written: so is the query (H q / n), which keeps the scores
        rotation = tl.load(rotation_ptr + dims[:, None] * DIM_PAD + dims[None, :])
        inverse = tl.load(rotation_ptr + DIM_PAD * DIM_PAD + dims)
        q = tl.dot(q.to(tl.float32), rotation, input_precision="ieee") * inverse[None, :]
    q = q.to(DOT_DTYPE)

    # --- this split's share of the context tiles (causal: stop at the last row's position)
    kv_len = tl.minimum(seq_len, context_len + local_start + BLOCK_Q)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    first_tile = tl.maximum(context_len + local_start - window + 1, 0) // TILE_N  # the window's start
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    block_table = block_tables_ptr + req * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_begin, tile_end):
        key_pos = tile * TILE_N + offs_n  # [TILE_N]
        key_valid = key_pos < kv_len
        physical_block = tl.load(block_table + key_pos // block_size, mask=key_valid, other=0)
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        if QUANTIZED:
            k, v = _load_codes(key_cache_ptr, value_cache_ptr, physical_block.to(tl.int64) * stride_cb
                               + kv_head * stride_ch, key_pos % block_size, dims, key_valid, kv_mask, block_size,
                               HEAD_DIM)
        else:
            kv_offset = (
                physical_block.to(tl.int64) * stride_cb + (key_pos % block_size) * stride_cs
                + kv_head * stride_ch
            )  # [TILE_N]
            k = tl.load(key_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(value_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(DOT_DTYPE)  # [TILE_N, DIM_PAD]
        v = v.to(DOT_DTYPE)

        # scores in log2 units, so the recurrence can use exp2: [BLOCK_M, TILE_N]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:  # c * tanh(s / c), tanh through exp (the interpreter has no tanh)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = s * LOG2E
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # online softmax; a row with nothing visible yet keeps m = -inf, so shift by 0
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if QUANTIZED:  # the sum of rotated values back to the values' space (H acc / n; linear, so splits too)
        acc = tl.dot(acc, rotation, input_precision="ieee") * inverse[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] into contiguous partials
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_mask)
        tl.store(part_max_ptr + row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + row, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_reqs"])
def _reduce_splits_kernel(
    out_ptr,  # [T, H, D]
    acc_ptr,  # [T, H, NUM_SPLITS, D] fp32
    max_ptr, sum_ptr,  # [T, H, NUM_SPLITS] fp32: running max (log2 units) and sum
    query_start_loc_ptr,  # [B + 1] int32
    num_reqs,
    num_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One program per (token, head): rescale each split to the common max and add up."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # padding token past the batch: never written by the attention kernel
    row = (token * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM

    m = tl.load(max_ptr + row + splits)  # [NUM_SPLITS]
    split_sums = tl.load(sum_ptr + row + splits)
    m_all = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # empty split -> 0
    total = tl.sum(split_sums * weight, axis=0)
    acc = tl.load(
        acc_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=dim_valid[None, :], other=0.0,
    )  # [NUM_SPLITS, DIM_PAD]
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty), mask=dim_valid,
    )


@functools.cache  # one buffer per device, not a concatenation per layer
def _rotation(head_dim: int, dim_pad: int, device: torch.device) -> torch.Tensor:
    """kv_write's rotation and its inverse divisors in one buffer, as the attention kernel reads them."""
    from kernels.triton.kv_write import rotation

    matrix, inverse = rotation(head_dim, dim_pad, device)
    return torch.cat([matrix.flatten(), inverse])


@dataclass(frozen=True)
class LaunchTuning:
    """The launch choices of decode-only batches (gpu_check's sweep measures them; docs/gpu.md has the figures).
    Prefill and mixed batches keep PREFILL_TUNING's tiles and never split."""

    tile_n: int = 64  # context positions per loop step
    num_warps: int = 4
    num_stages: int = 3  # software-pipelined K/V tile loads in flight per program
    programs_per_sm: int = 4  # split the context until about this many programs run per SM
    min_split_tokens: int = 128  # a split walks at least this many positions
    max_splits: int = 64


# by head dim (gpu_check's candidates on an H200, docs/gpu.md): 64-position tiles in two stages; 128-wide heads,
# twice the bytes a program, want half the programs; wider heads keep tiles whose stages fit in shared memory
DECODE_TUNINGS = {
    64: LaunchTuning(tile_n=64, num_stages=2, min_split_tokens=128),
    128: LaunchTuning(tile_n=64, num_stages=2, programs_per_sm=2, min_split_tokens=128),
    256: LaunchTuning(tile_n=32, num_stages=2, min_split_tokens=128),
}
PREFILL_TUNING = LaunchTuning(tile_n=64, num_warps=4, num_stages=3, programs_per_sm=0)


def decode_tuning(head_dim: int) -> LaunchTuning:
    """The decode launch for heads `head_dim` wide: the narrowest DECODE_TUNINGS entry that holds them."""
    return next((t for width, t in sorted(DECODE_TUNINGS.items()) if head_dim <= width), DECODE_TUNINGS[256])


# what the CPU interpreter assumes for the SM count: small, so tests meet splits at tiny shapes
INTERPRETER_SMS = 4


@dataclass(frozen=True)
class LaunchPlan:
    """One step's launch of the attention kernel, the same for every layer (cached in metadata.scratch)."""

    block_m: int
    block_q: int
    decode_only: bool  # one program per request (and kv head, and split): no search for the request
    tile_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    num_q_blocks: int


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(metadata: AttentionMetadata, num_kv_heads: int, num_sms: int | None = None,
                      tuning: LaunchTuning | None = None, head_dim: int = 64) -> int:
    """Decode-only batches split each context until about `programs_per_sm` programs run per SM (flash
    decoding), each split walking at least `min_split_tokens` of max_seq_len; prefill and mixed batches never
    split. A power of two, so a handful of kernel variants covers every batch (and each is compiled at warm-up).
    Under a CUDA graph max_seq_len is the capture bound: the count is fixed per graph, and splits past a
    shorter context find no tiles and write an empty partial."""
    if metadata.max_query_len > 1:
        return 1
    tuning = tuning or decode_tuning(head_dim)
    if num_sms is None:
        num_sms = multiprocessor_count(metadata.seq_lens.device)
    programs = metadata.num_reqs * num_kv_heads
    wanted = -(-num_sms * tuning.programs_per_sm // programs)
    splits = min(wanted, metadata.max_seq_len // tuning.min_split_tokens, tuning.max_splits)
    if splits < 2:
        return 1
    return 1 << (splits - 1).bit_length() if splits & (splits - 1) else splits  # round up to a power of two


def plan_launch(metadata: AttentionMetadata, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                batch_invariant: bool, num_splits: int | None = None, tuning: LaunchTuning | None = None) -> LaunchPlan:
    """Tiles, query blocks and the split count for this batch of `num_tokens` query rows (padding included)."""
    queries_per_kv = num_heads // num_kv_heads
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    # decode-only batches need one token per program; prefill gets taller query blocks
    decode_only = metadata.max_query_len == 1 and not batch_invariant
    if tuning is None:
        tuning = decode_tuning(head_dim) if decode_only else PREFILL_TUNING
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(queries_per_kv))
    block_q = 1 if decode_only else block_m // queries_per_kv  # a decode's one token: its heads' rows, the rest masked
    if batch_invariant and interpreted:
        # the interpreter's tl.dot is numpy's BLAS, whose sums depend on a row's place in the block (a GPU's
        # MMA computes every row alike): one token per block there, so a token's rows always lie at the top
        block_m, block_q = max(16, triton.next_power_of_2(queries_per_kv)), 1
    if batch_invariant:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(metadata, num_kv_heads, tuning=tuning) if decode_only else 1
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    return LaunchPlan(block_m=block_m, block_q=block_q, decode_only=decode_only, tile_n=tuning.tile_n,
                      num_splits=num_splits, num_warps=tuning.num_warps, num_stages=tuning.num_stages,
                      # else an upper bound, see module docstring
                      num_q_blocks=metadata.num_reqs if decode_only else num_tokens // block_q + metadata.num_reqs)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    num_splits: int | None = None,  # None: choose from metadata; tests force it
    batch_invariant: bool = False,
    tuning: LaunchTuning | None = None,  # None: decode_tuning(D) / PREFILL_TUNING; gpu_check's sweep passes others
) -> torch.Tensor:  # [T, H, D]
    """Causal paged attention for every token of the batch, decodes and prefill chunks alike.
    `batch_invariant`: one tiling whatever the batch (prefill's query blocks and key tiles for decodes too,
    no context splits), so a row's sums never depend on the rows beside it."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    out = torch.empty_like(query)
    if num_tokens == 0 or metadata.num_reqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1

    # every layer of a step launches alike: plan (and the split partials) once per step
    key = ("triton_attention", num_tokens, num_heads, num_kv_heads, head_dim, batch_invariant, num_splits, tuning)
    plan = metadata.scratch.get(key)
    if plan is None:
        plan = plan_launch(metadata, num_tokens, num_heads, num_kv_heads, head_dim, batch_invariant=batch_invariant,
                           num_splits=num_splits, tuning=tuning)
        metadata.scratch[key] = plan
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    dot_dtype = _DOT_DTYPES[query.dtype]
    if dot_dtype == tl.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        dot_dtype = tl.float32  # the CPU interpreter multiplies bf16 bit patterns as integers

    splits = plan.num_splits
    if splits == 1:
        acc = m = sums = out  # partial buffers unused
    else:  # one set per step: the layers run one after another on one stream
        partials = ("triton_attention_partials", num_tokens, num_heads, splits, head_dim, query.device)
        if partials not in metadata.scratch:
            metadata.scratch[partials] = (
                query.new_empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32),
                query.new_empty(num_tokens, num_heads, splits, dtype=torch.float32),
                query.new_empty(num_tokens, num_heads, splits, dtype=torch.float32),
            )
        acc, m, sums = metadata.scratch[partials]

    quantized = is_quantized(key_cache.dtype)
    _attention_kernel[(plan.num_q_blocks, num_kv_heads, splits)](
        out, acc, m, sums, query, key_cache, value_cache,
        metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        metadata.num_reqs, num_heads, scale, sliding_window or 1 << 30, logit_softcap or 0.0,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(2), key_cache.stride(1),  # block, slot, head
        metadata.block_tables.stride(0),
        key_cache.shape[2],
        HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, TILE_N=plan.tile_n,
        NUM_SPLITS=splits,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        SOFTCAP=logit_softcap is not None,
        QUANTIZED=quantized,
        DECODE_ONLY=plan.decode_only,
        rotation_ptr=_rotation(head_dim, dim_pad, query.device) if quantized else None,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, acc, m, sums, metadata.query_start_loc, metadata.num_reqs, num_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits,
        )
    return out
