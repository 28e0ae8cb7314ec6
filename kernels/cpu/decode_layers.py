"""Pre-norm decoder layers as one C++ op each at decode, on the CPU (kernels/cpu/csrc/decode_layer.cpp).

At a one-row decode step a SmolLM2 layer is ten small kernels (two norms, four int8 GEMVs,
rotary, the KV write, attention, SiLU * mul), and reaching each from Python (module calls,
torch.ops boxing, temporaries) costs about as much as the kernel (docs/cpu-kernels.md#decoder-layers-as-one-c-op
has the figures). Where the layers use the C++ fused ops
and attention and every linear runs one of Tandem's own kernels (`OP_KERNELS`), `CpuDecodeLayers`
runs each layer as one op over scratch tensors made once per step. The op calls the same kernels
in the same order as the module path, so the outputs are the same. With LoRA it also adds each
adapter row's products after each linear (`attach_lora`, kernels/cpu/csrc/lora.cpp), so decode steps
that mix adapters stay one op per layer.

Whether it pays is measured at load like every kernel choice (`choose_decode_layers`), per
bucket up to 128 rows (decode batches and short prefill chunks): the model's layers run once
through the op and once through the modules (each linear on its measured plan), on a scratch KV
cache, and the op is kept for the buckets where it wins. Up to 8 rows the op runs every linear
on a GEMV (one read of each weight): the int8 one, or the int4 one where the weights are int4 (a
Q4_0 / Q4_1 GGUF, `--quantization int4`), both timed, and beside them the linears' own plans where
the op can run those; the linears' plans then name what the op won with; above,
each linear runs the kernel its plan names for the bucket (int8_vnni, linear_bf16_packed, ...),
if the op can call it.
Kernels the user pinned (`--linear-kernels`) are never overridden: the op runs a pinned linear on its
pinned kernel, its outputs the module path's exactly, and is not used from the first bucket where a
pinned kernel is one it cannot run (the modules run it there).
Where the layers do not fit (biases, q/k norms, Gemma's layers, the torch attention or layer
ops, `--enforce-eager`, quantization none) or the op loses, the model keeps its module path.

The model says what its layers compute (a `DecoderStack`, engine_core/models/llama.py), or None where they
are not this shape; the kernels choose whether and how to run them as the op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kernels.attention_metadata import AttentionMetadata
from kernels.cpu.int4_linear import prepare_int4_gemv
from kernels.cpu.int8_linear import prepare_int8_gemv
from kernels.cpu.linear import BUCKETS, allowed_kernels, int4_allowed, kernel_fits
from kernels.cpu.linear_timing import Timer, fastest_uncontended, one_thread, wall_timer
from kernels.kv_cache_layout import kv_cache_shape

logger = logging.getLogger(__name__)

GEMV = "int8_gemv"
INT4_GEMV = "int4_gemv"  # the GEMV buckets' other candidate, for linears whose weights are int4
GEMV_MAX_ROWS = 8  # up to here the op runs every linear on a GEMV; above, each linear's own plan
MAX_ROWS = 128  # the decode buckets the op is timed for
# the op's kernels (kinds, kernels/cpu/csrc/decode_layer.cpp)
OP_KERNELS = {"int8_gemv": 0, "int8_vnni": 1, "linear_bf16_packed": 2, "int4_gemv": 3, "int8_grouped": 4}
# the timed op variants, as logged
CANDIDATES = {"one_op": "op", "one_op_int4": "op with int4 GEMVs", "one_op_plans": "op on the linears' plans"}
_EMPTY = torch.empty(0)
LayerLinears = list[tuple[str, object]]  # one layer's four linears: (kernel name, its prepared state)
TIMING_CONTEXT = 128  # positions each row of the timing batch attends to
TIMING_BLOCK = 16


@dataclass(frozen=True)
class DecoderLayerSpec:
    """What one decoder layer computes, as the op runs it: x + attention(norm(x)), then + MLP(norm(.)), with a
    fused qkv projection, rotary embedding, paged attention, o, a fused gate/up with SiLU·mul, and down; no
    biases. `linears`: qkv, o, gate_up and down, in the op's order (nn.Linear before the plan, CpuLinear after)."""

    input_norm: torch.Tensor  # the two RMSNorms' weights, and their eps
    post_norm: torch.Tensor
    eps: float
    linears: tuple[nn.Module, nn.Module, nn.Module, nn.Module]
    scale: float  # attention's score scale, sliding window (0: none) and logit softcap (0: none)
    window: int
    softcap: float
    batch_invariant: bool = False  # attention never splits a context by the batch (the backend's setting)


@dataclass(frozen=True)
class DecoderStack:
    """A model's decoder layers as the op needs them, and its module path (the op's rival when timed).

    `embed(token ids) -> [T, hidden]`; `rope(positions, dtype) -> (cos, sin)` as the layers take it;
    `modules(h, rope, kv_caches, md)` runs every layer through the model's own modules."""

    layers: list[DecoderLayerSpec]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    embed: Callable[[torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
    modules: Callable[..., object]


def _op_args(kernel: str, state) -> tuple:
    """One linear's arguments to the op: its kind and four tensors from the kernel's prepared state
    (kernels/cpu/int8_linear.py, kernels/cpu/bf16_linear.py)."""
    if kernel == "int8_gemv":
        packed, scale = state[:2]
        return OP_KERNELS[kernel], packed, scale, _EMPTY, _EMPTY
    if kernel in ("int8_vnni", "int8_grouped"):
        packed, w_scale, offsets, bias = state[:4]
        return OP_KERNELS[kernel], packed, w_scale, offsets, bias
    if kernel == "linear_bf16_packed":
        packed, bias = state[:2]
        return OP_KERNELS[kernel], packed, bias, _EMPTY, _EMPTY
    if kernel == "int4_gemv":
        return OP_KERNELS[kernel], state[0], _EMPTY, _EMPTY, _EMPTY
    raise ValueError(f"the decoder-layer op cannot run {kernel}")


class CpuDecodeLayers:
    """Runs a model's decoder layers, one op each, for steps of up to `max_rows` rows.

    `linears[rows]`: for the steps of that bucket (more rows than the bucket below), each layer's
    qkv, o, gate_up and down as (kernel name, prepared state)."""

    def __init__(self, stack: DecoderStack, linears: dict[int, list[LayerLinears]]):
        self.buckets = sorted(linears)
        self.max_rows = self.buckets[-1]
        self.num_heads, self.num_kv_heads, self.head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
        qkv, _, _, down = stack.layers[0].linears
        self.qkv_size = qkv.out_features
        self.hidden_size, self.intermediate_size = down.out_features, down.in_features
        # per bucket and layer: the op's arguments before the KV cache
        self.weights = {
            rows: [(layer.input_norm, layer.post_norm, layer.eps,
                    *(arg for kernel, state in layer_linears for arg in _op_args(kernel, state)))
                   for layer, layer_linears in zip(stack.layers, by_layer)]
            for rows, by_layer in linears.items()
        }
        # per layer: its attention settings after the KV cache
        self.attention = [(layer.scale, layer.window, layer.softcap, layer.batch_invariant) for layer in stack.layers]
        # per layer: the adapter slots (A, B, pieces) of qkv, o, gate_up and down, once LoRA is attached
        self.lora_slots: list[tuple[torch.Tensor, ...]] = [(_EMPTY,) * 12 for _ in stack.layers]
        self.serves_lora = False  # until attach_lora: a step with adapter rows takes the module path

    def attach_lora(self, slots_by_layer: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]]) -> None:
        """Each layer's adapter slots, (A, B, pieces) per linear in the op's order (None: a linear without
        adapters; engine_core/lora/layers.py): the op adds their products for the rows that name a slot
        (kernels/cpu/csrc/lora.cpp)."""
        self.lora_slots = [tuple(t for slots in layer for t in (slots or (_EMPTY,) * 3)) for layer in slots_by_layer]
        self.serves_lora = True

    def __call__(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches, md: AttentionMetadata,
        lora_row_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [T, hidden]) -> (last layer's output, residual), as the layer loop returns them.
        `lora_row_slots` [T] int64: each row's adapter slot (-1: the base model), for a step with adapter rows."""
        T = h.shape[0]
        # the first layer's norm(x + 0) is its norm(x) exactly, so every layer is the same op
        residual = torch.zeros_like(h)
        qkv = h.new_empty(T, self.qkv_size)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, : (heads + kv_heads) * dim].view(T, heads + kv_heads, dim)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * dim:].view(T, kv_heads, dim)
        attn = h.new_empty(T, heads, dim)
        step = (
            rope[0].squeeze(1), rope[1].squeeze(1), md.slot_mapping, md.block_tables, md.seq_lens,
            md.query_start_loc, qkv, qk, q, k, v, attn, attn.view(T, heads * dim),
            h.new_empty(T, self.hidden_size), h.new_empty(T, 2 * self.intermediate_size),
            h.new_empty(T, self.intermediate_size),
        )
        op = torch.ops.tandem.llama_decode_layer
        weights_by_layer = self.weights[next(rows for rows in self.buckets if rows >= T)]
        rows_slots = _EMPTY if lora_row_slots is None else lora_row_slots
        for weights, attention, (key_cache, value_cache), lora in zip(
                weights_by_layer, self.attention, kv_caches, self.lora_slots):
            op(h, residual, *weights, key_cache, value_cache, *attention, *step, rows_slots, *lora)
        return h, residual


# ---- choosing by measurement ----

def choose_decode_layers(
    stack: DecoderStack, weights: list[list[torch.Tensor]], quantization: str, timer: Timer = wall_timer,
    kv_cache_dtype: torch.dtype | None = None,
) -> CpuDecodeLayers | None:
    """Time the layers as one op against the module path per decode bucket (up to MAX_ROWS, from the
    smallest, until the op first loses) and return the op for the buckets it wins; the linears of
    the GEMV buckets have their plans switched to the GEMV the op won with there (int8, or int4 for
    the linears whose weights are int4). `weights`: each layer's four float weights, taken before the
    linears were planned (a plan may free them). `kv_cache_dtype`: the KV cache's element type (None: the
    model's dtype); the op reads a cache of the model's dtype or an int8 one. None where the GEMV is not allowed,
    the cache is another, or the op never wins."""
    kv_cache_dtype = kv_cache_dtype or stack.dtype
    if GEMV not in allowed_kernels(quantization):
        return None
    if kv_cache_dtype not in (stack.dtype, torch.int8):
        logger.info("decoder layers as one C++ op: not used (its attention reads a KV cache of the model's dtype or "
                    "int8, not %s)", kv_cache_dtype)
        return None
    if not all(kernel_fits(GEMV, w) for layer in weights for w in layer):
        return None
    linears = [list(layer.linears) for layer in stack.layers]
    with one_thread():  # many small packing ops: see linear_timing.one_thread
        int8_gemvs = [[(GEMV, linear.state(GEMV) or prepare_int8_gemv(w, None)) for linear, w in zip(layer, layer_ws)]
                      for layer, layer_ws in zip(linears, weights)]
        int4_gemvs = [[_int4_gemv_or(int8, linear, w, quantization) for int8, linear, w in zip(*layer)]
                      for layer in zip(int8_gemvs, linears, weights)]
    gemv_candidates = {"one_op": int8_gemvs}
    if _kernel_names(int4_gemvs) != _kernel_names(int8_gemvs):  # some weights are int4
        gemv_candidates["one_op_int4"] = int4_gemvs
    if quantization == "auto":  # a GEMV past a linear's accuracy budget is the user's to ask for, as in the linears
        gemv_candidates = {name: candidate for name, candidate in gemv_candidates.items()
                           if _within_budget(candidate, linears)}
    chosen: dict[int, list[LayerLinears]] = {}
    results = []
    for rows in (b for b in BUCKETS if b <= MAX_ROWS):
        kernels = [[linear.kernel_for(rows) for linear in layer] for layer in linears]
        outside = {kernel for layer in kernels for kernel in layer} - set(OP_KERNELS)
        plans = [[(kernel, linear.state(kernel)) for linear, kernel in zip(layer, layer_kernels)]
                 for layer, layer_kernels in zip(linears, kernels)]
        pinned = [[rows in linear.pinned for linear in layer] for layer in linears]
        pinned_outside = {kernel for layer, layer_pins in zip(kernels, pinned)
                          for kernel, pin in zip(layer, layer_pins) if pin} - set(OP_KERNELS)
        if pinned_outside:  # the op would have to run another kernel there: the modules run the user's
            results.append(f"{rows} rows: pinned kernels not in the op ({', '.join(sorted(pinned_outside))})")
            break
        if rows <= GEMV_MAX_ROWS:
            # the GEMVs, and each linear's own plan where the op can run it and it is not a GEMV
            # one already (at 8 rows W8A8 through int8_vnni may beat streaming the weight); a pinned
            # linear keeps its kernel in every candidate
            candidates = {name: _keep_pins(candidate, plans, pinned) for name, candidate in gemv_candidates.items()}
            if not outside and all(_kernel_names(plans) != _kernel_names(c) for c in candidates.values()):
                candidates["one_op_plans"] = plans
        elif outside:
            results.append(f"{rows} rows: not in the op ({', '.join(sorted(outside))})")
            break
        else:
            candidates = {"one_op": plans}
        if not candidates:
            results.append(f"{rows} rows: no GEMV within the linears' accuracy budget")
            break
        timings = _time_passes(stack, {name: CpuDecodeLayers(stack, {rows: candidate})
                                       for name, candidate in candidates.items()}, rows, timer, kv_cache_dtype)
        best = min(candidates, key=timings.get)
        variants = ", ".join(f"{CANDIDATES[name]} {timings[name] * 1e3:.2f} ms" for name in candidates)
        results.append(f"{rows} rows: {variants}, modules {timings['modules'] * 1e3:.2f} ms")
        if timings[best] >= timings["modules"]:
            break
        chosen[rows] = candidates[best]
    logger.info("decoder layers as one C++ op: %s; %s", f"up to {max(chosen)} rows" if chosen else "not used",
                "; ".join(results))
    if not chosen:
        return None
    # the GEMV buckets' plans as the op runs them there, the largest first so that a smaller
    # bucket's choice stands below it
    for rows in sorted((rows for rows in chosen if rows <= GEMV_MAX_ROWS), reverse=True):
        for layer, layer_linears in zip(linears, chosen[rows]):
            for linear, (kernel, state) in zip(layer, layer_linears):
                linear.take_kernel_up_to(rows, kernel, state)
    return CpuDecodeLayers(stack, chosen)


def _int4_gemv_or(int8_gemv: tuple[str, object], linear, weight: torch.Tensor, quantization: str) -> tuple[str, object]:
    """The linear on the int4 GEMV where `quantization` takes its weight as int4 and the kernel fits,
    else its int8 GEMV."""
    if not (int4_allowed(quantization, weight) and kernel_fits(INT4_GEMV, weight)):
        return int8_gemv
    return INT4_GEMV, linear.state(INT4_GEMV) or prepare_int4_gemv(weight, None)


def _within_budget(candidate: list[LayerLinears], linears) -> bool:
    """Whether every linear's kernel in `candidate` is within that linear's accuracy budget."""
    return all(linear.within_budget(kernel) for layer, layer_linears in zip(candidate, linears)
               for (kernel, _), linear in zip(layer, layer_linears))


def _keep_pins(candidate: list[LayerLinears], plans: list[LayerLinears],
               pinned: list[list[bool]]) -> list[LayerLinears]:
    """`candidate` with each pinned linear on its plan's (pinned) kernel instead."""
    return [[plan if pin else own for own, plan, pin in zip(*layer)] for layer in zip(candidate, plans, pinned)]


def _kernel_names(candidate: list[LayerLinears]) -> list[list[str]]:
    return [[kernel for kernel, _ in layer] for layer in candidate]


@torch.inference_mode()
def _time_passes(stack: DecoderStack, ops: dict[str, CpuDecodeLayers], rows: int, timer: Timer,
                 kv_cache_dtype: torch.dtype) -> dict[str, float]:
    """Seconds per pass over every layer for `rows` decode rows of TIMING_CONTEXT positions each,
    through each of `ops` (by name) and through the modules ("modules"), on a scratch KV cache of
    `kv_cache_dtype`."""
    per_row = -(-(TIMING_CONTEXT + 1) // TIMING_BLOCK)
    dtype = kv_cache_dtype
    some_op = next(iter(ops.values()))
    shape = kv_cache_shape(rows * per_row + 1, some_op.num_kv_heads, TIMING_BLOCK, some_op.head_dim, dtype)  # 0: null
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in stack.layers]
    block_tables = torch.arange(1, rows * per_row + 1, dtype=torch.int32).view(rows, per_row)
    md = AttentionMetadata(
        slot_mapping=block_tables[:, TIMING_CONTEXT // TIMING_BLOCK].long() * TIMING_BLOCK
        + TIMING_CONTEXT % TIMING_BLOCK,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.full((rows,), TIMING_CONTEXT + 1, dtype=torch.int32),
        block_tables=block_tables, max_query_len=1, max_seq_len=TIMING_CONTEXT + 1, num_decodes=rows,
        query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=[TIMING_CONTEXT + 1] * rows,
    )
    h0 = stack.embed(torch.arange(rows))
    rope = stack.rope(torch.full((rows,), TIMING_CONTEXT), h0.dtype)

    def modules():
        stack.modules(h0.clone(), rope, caches, md)

    def pass_through(op: CpuDecodeLayers):
        return lambda: op(h0.clone(), rope, caches, md)

    timings, _ = fastest_uncontended({"modules": modules, **{name: pass_through(op) for name, op in ops.items()}},
                                     rows, timer)
    return timings
