"""Linear layers on CPU, each batch size served by the kernel measured fastest on this machine.

CPUs differ (Intel with AMX, Intel without bf16, AMD with AVX512-BF16) and so does the fastest
way to multiply by a weight: row-major `F.linear` (oneDNN/MKL), a column-major `mm`, weights
prepacked once for oneDNN (kernels/cpu/onednn_linear.py) or for Tandem's bf16 GEMM for decode batches
(kernels/cpu/bf16_linear.py), int8 weight-only (`torch._weight_int8pack_mm`,
memory-bound decode), the same int8 weights through Tandem's C++ GEMV for a few rows (`int8_gemv`,
streaming the weight at close to memory speed), int8 dynamic W8A8 (per-token int8 activations x
int8 weights through `torch._int_mm`, VNNI/AMX, compute-bound batches; or through Tandem's GEMM
over a VNNI-packed weight, `int8_vnni`, for decode batches) or int4 in GGUF's 4-bit
blocks (kernels/cpu/int4_linear.py: torch's `int4`, or Tandem's C++ GEMV for a few rows, `int4_gemv`).
The loader times each allowed kernel on the model's real shapes per batch bucket (`choose_plan`)
and swaps every `nn.Linear` for a `CpuLinear` that dispatches on the number of rows
(`use_measured_linears`). A user may pin kernels instead (`--linear-kernels`): a pinned layer and
bucket is never timed nor cached.

Quantized weights are made on load from the float ones: int8 in kernels/cpu/int8_linear.py, int4 in
kernels/cpu/int4_linear.py (tests/kernels/test_cpu_linear.py states the tolerances and why). Each kernel's
reference, the exact product of the weight it holds, is in kernels/reference/linear.py.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import accuracy_budget, linear_plan_cache, linear_timing
from kernels.cpu import extension as cpu_extension
from kernels.cpu.accuracy_budget import AccuracyVerdict
from kernels.cpu.bf16_linear import bf16_packed_supported, prepare_bf16_packed, run_bf16_packed
from kernels.cpu.int4_linear import (
    GROUP_SIZE,
    dequantize_int4,
    int4_gemv_supported,
    int4_supported,
    prepare_int4,
    prepare_int4_gemv,
    quantize_int4,
    run_int4,
    run_int4_gemv,
)
from kernels.cpu.int8_blockwise import (
    int8_blockwise_fits,
    int8_blockwise_is_exact,
    prepare_int8_blockwise,
    run_int8_blockwise,
)
from kernels.cpu.int8_linear import (  # noqa: F401 (quantize_int8 / dequantize_int8 re-exported)
    dequantize_int8,
    int8_grouped_fits,
    int8_vnni_supported,
    int_mm_is_exact,
    prepare_int8_dynamic,
    prepare_int8_gemv,
    prepare_int8_grouped,
    prepare_int8_vnni,
    prepare_int8_weight_only,
    quantize_int8,
    run_int8_dynamic,
    run_int8_gemv,
    run_int8_grouped,
    run_int8_vnni,
    run_int8_weight_only,
)
from kernels.cpu.linear_timing import Race, Timer, one_thread, rotating, settled_race
from kernels.cpu.linear_timing import wall_timer as _wall_timer  # a module global: tests swap the clock here
from kernels.cpu.onednn_linear import onednn_supported, prepare_onednn, run_onednn

logger = logging.getLogger(__name__)

# Rows timed at load; a call takes the smallest bucket >= its rows, else the last. 512 stands for
# prefill chunks (hundreds to thousands of rows, compute-bound): 128 rows ranked the kernels as a
# noisy load could flip, 256 and more as prefill does (docs/cpu-kernels.md#how-a-linear-layer-chooses-its-kernel).
BUCKETS = (1, 8, 32, 128, 512)
class LinearRole(str, enum.Enum):
    """What the model knows about one of its linears that limits the kernels it may take; the model names
    its layers' roles (engine_core/models/layers.py), the kernels only act on them. The values are the
    plan cache's keys."""

    ANY = "any"
    OUTPUT_HEAD = "lm_head"  # the vocabulary projection: decode-sized batches only; int4 too lossy here
    OUTLIER_INPUT = "down_proj"  # its input has outlier channels (an MLP's SiLU·mul): no per-token W8A8


HEAD_MAX_ROWS = 128  # the LM head sees one row per sampling request (max_num_seqs): not timed above
FLOAT_KERNELS = ("linear", "linear_colmajor", "linear_onednn", "linear_bf16_packed")  # timed in auto and none
# F.linear's products in another order (within every budget), pinned only (batch-invariant mode): never timed
UNTIMED_FLOAT_KERNELS = ("linear_rowwise",)
INT8_KERNELS = ("int8_weight_only", "int8_dynamic", "int8_gemv", "int8_vnni", "int8_grouped", "int8_blockwise")
W8A8_KERNELS = ("int8_dynamic", "int8_vnni")  # activations rounded to int8 per token (the same arithmetic)
GROUPED_KERNELS = ("int8_grouped",)  # activations rounded to int8 per token and group of k: down_proj's W8A8
# W8A8 in GGUF's blocks of 32 k on the weight's own codes (kernels/cpu/int8_blockwise.py): in auto only where
# exact, and there instead of the W8A8 kernels above, which round such a weight a second time
BLOCKWISE_KERNELS = ("int8_blockwise",)
# Kernels built for small batches, never timed above this many rows: the last bucket's kernel also
# serves every larger batch (prefill chunks of thousands of rows), which its timing cannot see.
# int8_vnni keeps one 8-row register tile per weight pass: ahead of oneDNN's int8 GEMM (int8_dynamic)
# up to 512 rows (a CPU step's default budget: its quantize and rescale run inside the GEMM, not as two
# more passes over the rows), behind it at 2048, with the same bits (docs/cpu-kernels.md#int8_vnni).
# linear_bf16_packed, the same tiles in bf16, ahead of oneDNN at 32 and level at 128, stays at 32: its sums round
# differently from oneDNN's in ~0.01 % of outputs, and on the 128 bucket that flipped SmolLM2's
# greedy bf16 chat answer (tests/test_default_model.py) from "Paris" to "L'Étoile ...", an answer
# on a knife's edge (per-token W8A8 on down_proj flipped it the same way).
# int4_gemv streams 5-bit weights for a few rows, ahead of int8_gemv at one row (docs/cpu-kernels.md#int4_gemv),
# and is level with int8_gemv by 8, where its group-by-group fp32 sums cost as much as the reads saved.
MAX_ROWS = {"int8_vnni": 512, "linear_bf16_packed": 32, "int4_gemv": 8}
INT4_KERNELS = ("int4", "int4_gemv")  # only where the weights are int4 (see _kernels_for)
# Kernels whose every output is one row's sums in an order fixed by the kernel, whatever the number of rows
# or threads (split by output only): what --batch-invariant runs (`batch_invariant_kernel`). Pinned, never
# timed: linear_bf16_packed's register tiles keep each row's k order, linear_rowwise calls F.linear per row.
BATCH_INVARIANT_KERNELS = ("linear_bf16_packed", "linear_rowwise")
QUANTIZATIONS = ("auto", "int8", "int4", "none")
_TIMING_BYTES = 64 * 2**20  # weights timed in turn: enough to leave the caches, as a real step does
_MIN_CALLS = 8  # timed calls per kernel and bucket at least (more while under _BUDGET_S)
_BUDGET_S = 0.02  # timed seconds per bucket, all kernels together, before the extra calls stop
_EXACTNESS_ROWS = 64  # rows of a weight `int4_is_exact` checks (a GGUF tensor has one type throughout)

Plan = list[tuple[int, str]]  # (max rows, kernel name), ascending; the last entry takes any larger batch
# kernels pinned by the user (engine_core/config.py parses `--linear-kernels`): a linear's attribute name,
# or "*" for every linear, -> {bucket: kernel}, bucket None standing for every bucket of the layer; a pin for
# one bucket overrides one for every bucket, and a linear's own pins "*"'s
Pins = Mapping[str, Mapping[int | None, str]]


# ---- the kernels: prepare(weight, bias) -> state, run(state, x [N, in]) -> [N, out] ----

def _prep_linear(w, b):
    return w.contiguous(), b


def _run_linear(state, x):
    return F.linear(x, *state)


def _prep_colmajor(w, b):
    return w.t().contiguous(), b  # [in, out]: x @ W^T without a transpose in the BLAS call


def _run_colmajor(state, x):
    wt, b = state
    return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)


def _run_rowwise(state, x):
    """`F.linear` one row at a time: every row goes through the same call on the same shape, so its sums
    never depend on the batch (a BLAS picks its blocking, and its order of sums, by the number of rows).
    Batch-invariant mode's kernel where `linear_bf16_packed` cannot run; it reads the weight once a row."""
    w, b = state
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    for i in range(x.shape[0]):
        out[i : i + 1] = F.linear(x[i : i + 1], w, b)
    return out


KERNELS = {
    "linear": (_prep_linear, _run_linear),
    "linear_colmajor": (_prep_colmajor, _run_colmajor),
    "linear_rowwise": (_prep_linear, _run_rowwise),
    "int8_weight_only": (prepare_int8_weight_only, run_int8_weight_only),
    "int8_dynamic": (prepare_int8_dynamic, run_int8_dynamic),
    "int8_gemv": (prepare_int8_gemv, run_int8_gemv),
    "int8_vnni": (prepare_int8_vnni, run_int8_vnni),
    "int8_grouped": (prepare_int8_grouped, run_int8_grouped),
    "int8_blockwise": (prepare_int8_blockwise, run_int8_blockwise),
    "linear_onednn": (prepare_onednn, run_onednn),
    "linear_bf16_packed": (prepare_bf16_packed, run_bf16_packed),
    "int4": (prepare_int4, run_int4),
    "int4_gemv": (prepare_int4_gemv, run_int4_gemv),
}


def kernel_fits(kernel: str, weight: torch.Tensor) -> bool:
    """Whether `kernel` can hold this weight: torch packs int4 only for some shapes, oneDNN only
    the float types this build and CPU support, W8A8 needs an int8 GEMM that does not saturate, the
    int8 GEMV Tandem's C++ kernels and int8_vnni (linear_bf16_packed) those kernels built for
    AVX512-VNNI (AVX512-BF16, bf16 weights); int4_gemv like int8_vnni, in whole groups of 32;
    int8_grouped like int8_vnni, in whole activation groups."""
    if kernel == "int4":
        return int4_supported(*weight.shape)
    if kernel == "int4_gemv":
        return int4_gemv_supported(weight)
    if kernel == "linear_onednn":
        return onednn_supported(weight.dtype)
    if kernel == "int8_dynamic":
        return int_mm_is_exact()
    if kernel == "int8_gemv":
        return weight.dtype in (torch.float32, torch.bfloat16) and cpu_extension.load()
    if kernel == "linear_bf16_packed":
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and bf16_packed_supported()
    if kernel == "int8_vnni":
        return weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 4 == 0 and int8_vnni_supported()
    if kernel == "int8_grouped":
        return int8_grouped_fits(weight)
    if kernel == "int8_blockwise":
        return int8_blockwise_fits(weight)
    return True


def batch_invariant_kernel(dtype: torch.dtype) -> str:
    """The linear kernel batch-invariant mode runs for weights of `dtype` on this CPU: the bf16 GEMM over
    packed tiles where the CPU has AVX512-BF16, else F.linear row by row (slower: the weight read per row)."""
    if dtype == torch.bfloat16 and bf16_packed_supported():
        return "linear_bf16_packed"
    return "linear_rowwise"


def int4_is_exact(weight: torch.Tensor) -> bool:
    """Whether int4 reproduces `weight` within the rounding of its own dtype (2 eps of each group's
    largest magnitude): true for weights dequantized from a Q4_0 / Q4_1 GGUF (kernels/cpu/int4_linear.py),
    false by far for a float checkpoint (int4's step is ~6 % of a group's largest magnitude)."""
    if not int4_supported(*weight.shape):
        return False
    w = weight.detach()[:: max(1, weight.shape[0] // _EXACTNESS_ROWS)].float()  # evenly spaced rows
    error = (dequantize_int4(*quantize_int4(w)) - w).abs().reshape(w.shape[0], -1, GROUP_SIZE)
    group_max = w.abs().reshape(w.shape[0], -1, GROUP_SIZE).amax(-1, keepdim=True)
    return bool((error <= 2 * torch.finfo(weight.dtype).eps * group_max).all())


def int4_allowed(quantization: str, weight: torch.Tensor) -> bool:
    """Whether `quantization` lets this weight run an int4 kernel: `int4` always, `auto` where int4
    holds it exactly (`int4_is_exact`)."""
    return quantization == "int4" or (quantization == "auto" and int4_is_exact(weight))


class CpuLinear(nn.Module):
    """y = x W^T + b through the kernel that `plan` names for x's number of rows.

    Only the weight formats the plan uses are kept: an all-int8 plan frees the float weight.
    `prepared`: states already made by the kernels' prepare (from the load-time timing), reused.
    `accuracy`: the load's verdict on which kernels stay within this layer's accuracy budget
    (kernels/cpu/accuracy_budget.py); None: not measured, every kernel counts as within.
    """

    accuracy: AccuracyVerdict | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan,
                 prepared: dict[str, object] | None = None, pinned: Collection[int] = ()):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.has_bias = bias is not None
        self.pinned = frozenset(pinned)  # the plan's buckets whose kernel the user pinned: never changed
        prepared = prepared or {}
        states = {name: prepared[name] if name in prepared else
                  KERNELS[name][0](weight.detach(), None if bias is None else bias.detach())
                  for name in dict.fromkeys(name for _, name in plan)}
        self._use(list(plan), states)

    def _use(self, plan: Plan, states: dict[str, object]) -> None:
        """Take `plan`, keeping only the states it names (the rest are freed)."""
        self.plan = plan
        self._states = {name: states[name] for name in dict.fromkeys(name for _, name in plan)}
        # (max rows, run, state) per bucket: all forward looks at
        self._steps = [(limit, KERNELS[name][1], self._states[name]) for limit, name in plan]

    def within_budget(self, kernel: str) -> bool:
        return self.accuracy is None or self.accuracy.within(kernel)

    @property
    def lossy_kernels(self) -> list[str]:
        """The kernels this layer runs that lose more than its accuracy budget (asked for, or pinned)."""
        return [name for name in dict.fromkeys(name for _, name in self.plan) if not self.within_budget(name)]

    def state(self, name: str) -> object | None:
        """The prepared state of kernel `name` when the plan uses it, else None."""
        return self._states.get(name)

    def take_kernel_up_to(self, rows: int, name: str, state: object) -> None:
        """Run `name` (prepared as `state`) for every batch of up to `rows` rows; a kernel the plan
        no longer names is freed. Used where a choice above this layer (one op per decoder layer,
        kernels/cpu/decode_layers.py) was measured with `name` in these buckets. Pinned buckets
        keep their kernel (the op runs them there)."""
        plan = [(limit, name if limit <= rows and limit not in self.pinned else kernel) for limit, kernel in self.plan]
        self._use(plan, {**self._states, name: state})

    def kernel_for(self, rows: int) -> str:
        for limit, name in self.plan:
            if rows <= limit:
                return name
        return self.plan[-1][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # leading dims flattened and restored; the models pass [T, in] already
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        # at decode this runs for every linear of every layer, each a short kernel: no lookups beyond the plan
        rows = x.shape[0]
        for limit, run, state in self._steps:
            if rows <= limit:
                return run(state, x)
        _, run, state = self._steps[-1]  # larger than every bucket: the last kernel
        return run(state, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, plan={self.plan}"


# ---- choosing by measurement ----

def allowed_kernels(quantization: str) -> tuple[str, ...]:
    """none: float kernels only; int8: the int8 kernels; int4: the int4 kernels (the int8 ones for
    shapes they cannot take); auto: float kernels and the int8 kernels, plus the int4 ones for layers
    int4 holds exactly (`int4_is_exact`, checked by `_kernels_for`).

    In auto, W8A8 is timed like the rest and may win only where the GEMM is compute-bound, from 32
    rows on, never at 1 row (docs/cpu-kernels.md#w8a8-around-torch_int_mm). It never takes down_proj (`_kernels_for`).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    return {"none": FLOAT_KERNELS, "int8": INT8_KERNELS, "int4": INT4_KERNELS + INT8_KERNELS,
            "auto": FLOAT_KERNELS + INT8_KERNELS}[quantization]


def _kernels_for(quantization: str, weights: list[torch.Tensor], role: LinearRole) -> tuple[str, ...]:
    """The allowed kernels that fit every weight of a same-shape group (see `allowed_kernels`) in its role.

    int4 leaves the LM head at int8, as llama.cpp's Q4 files keep their output layer at 6-8 bits:
    an int4 head turned SmolLM2's "The capital of France is Paris." into "L'Étoile (The City of
    Lights) is the capital of France."

    Per-token W8A8 never takes an MLP's down projection: the SiLU·mul product feeding down_proj has
    outlier channels (as SmoothQuant found) that one int8 scale per token crushes. With it there the
    bf16 answer above once became "L'Étoile ...", and teacher-forced over 480 tokens of text SmolLM2's
    mean |log-prob change| against fp32 rose from 0.169 to 0.198. down_proj takes W8A8 with a scale
    per token and group of 128 k instead (`int8_grouped`): 0.175 there, the answer unchanged; the other
    linears keep per-token W8A8, a little faster. The LM head's input (the final norm's output) takes
    per-token W8A8: over 414 tokens it moved the mean |log-prob change| from 0.159 to 0.175, its top-1
    agreement within noise (0.889 -> 0.906), and the answer above stayed.

    Where the weights came from a Q4_0 / Q4_1 / Q8_0 GGUF, auto's W8A8 is `int8_blockwise` alone (every
    role: blocks of 32 k keep down_proj's outlier channels to their own block), exact on the weights and
    with llama.cpp's rounding of the activations (docs/cpu-kernels.md#accuracy).
    """
    if quantization == "int4" and role is LinearRole.OUTPUT_HEAD:
        quantization = "int8"
    kernels = [k for k in allowed_kernels(quantization) if all(kernel_fits(k, w) for w in weights)]
    if role is LinearRole.OUTLIER_INPUT:  # see the docstring
        kernels = [k for k in kernels if k not in W8A8_KERNELS] or kernels
    else:
        kernels = [k for k in kernels if k not in GROUPED_KERNELS] or kernels
    if quantization == "auto":  # see BLOCKWISE_KERNELS
        exact = all(int8_blockwise_is_exact(w) for w in weights)
        dropped = W8A8_KERNELS + GROUPED_KERNELS if exact else BLOCKWISE_KERNELS
        kernels = [k for k in kernels if k not in dropped] or kernels
    if quantization == "int4" and "int4" in kernels:
        kernels = [k for k in INT4_KERNELS if k in kernels]  # int8 is only the fallback for shapes int4 cannot take
    elif quantization == "auto" and all(int4_is_exact(w) for w in weights):
        kernels += [k for k in INT4_KERNELS if all(kernel_fits(k, w) for w in weights)]
    return tuple(kernels)


# A float kernel may be timed only if it computes what `F.linear` does in the weights' dtype, up to
# summation order: a library may pick a reduced-precision path for some CPU or shape (oneDNN's
# fpmath modes, AMX), and an fp32 model must not silently run bf16 or tf32 products. Of the output's
# spread: fp32 reorderings measured ~1e-6 at these shapes, tf32 inputs ~3e-4, bf16 inputs ~3e-3; the
# half-precision bounds allow one rounding of the output.
_FLOAT_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def float_kernel_is_accurate(name: str, state, weight: tuple[torch.Tensor, torch.Tensor | None],
                             x: torch.Tensor) -> bool:
    """Whether float kernel `name` (prepared as `state`) matches `F.linear` on `x` within the
    weights' dtype (`_FLOAT_TOLERANCE`); quantized kernels are lossy by design and always pass."""
    if name not in FLOAT_KERNELS or name == "linear":
        return True
    w, b = weight
    expected = F.linear(x, w, b).float()
    error = (KERNELS[name][1](state, x).float() - expected).abs().max().item()
    spread = expected.abs().max().item()
    if error <= _FLOAT_TOLERANCE.get(w.dtype, 2e-2) * spread:
        return True
    logger.warning("linear %dx%d: %s is off by %.2g (outputs up to %.2g) from F.linear in %s at %d rows "
                   "on this machine; not used", *w.shape, name, error, spread, w.dtype, x.shape[0])
    return False


def choose_plan(weights: list[tuple[torch.Tensor, torch.Tensor | None]], kernels: tuple[str, ...],
                buckets: tuple[int, ...] = BUCKETS, timer: Timer = _wall_timer,
                states: dict[str, list] | None = None) -> tuple[Plan, dict, dict[int, Race]]:
    """Time each kernel on `weights` (same-shape layers, taken in turn) at each bucket, a float
    kernel only where it is accurate here (`float_kernel_is_accurate`); `states`: each kernel's
    prepared state per weight, when the caller made them already. A noisy bucket is retaken
    (`settled_race`) until one stays noisy: the plan cannot be kept then, and the rest time once.

    Returns the plan (fastest kernel per bucket), the timings {rows: {kernel: seconds per layer}}
    and each bucket's race (how noisy).
    """
    in_features, dtype = weights[0][0].shape[1], weights[0][0].dtype
    if states is None:
        states = {name: [KERNELS[name][0](w, b) for w, b in weights] for name in kernels}
    races: dict[int, Race] = {}
    for rows in buckets:
        x = torch.randn(rows, in_features, dtype=dtype)
        fit = [name for name in kernels if rows <= MAX_ROWS.get(name, rows)] or list(kernels)
        fit = [name for name in fit if float_kernel_is_accurate(name, states[name][0], weights[0], x)] or fit
        candidates = {name: rotating(KERNELS[name][1], states[name], x) for name in fit}
        retakes = 0 if any(race.noisy for race in races.values()) else linear_timing.RETAKES
        races[rows] = settled_race(candidates, rows, timer, retakes, min_rounds=_MIN_CALLS,
                                   max_rounds=4 * _MIN_CALLS, budget_s=_BUDGET_S)
        if races[rows].contended:
            logger.info("%d rows: the machine is oversubscribed, kernels ranked by one-thread times", rows)
    timings = {rows: race.timings for rows, race in races.items()}
    plan = [(rows, min(timings[rows], key=timings[rows].get)) for rows in buckets]
    return plan, timings, races


def _buckets_for(role: LinearRole, buckets: tuple[int, ...]) -> tuple[int, ...]:
    if role is LinearRole.OUTPUT_HEAD:
        return tuple(b for b in buckets if b <= HEAD_MAX_ROWS) or buckets[:1]
    return buckets


def _pinned_buckets(pins: Pins, name: str, buckets: tuple[int, ...]) -> dict[int, str]:
    """{bucket: kernel} that `pins` fixes for the linear called `name`: its own pins over "*"'s."""
    own, every = pins.get(name, {}), pins.get("*", {})
    chosen = {rows: own.get(rows, own.get(None, every.get(rows, every.get(None)))) for rows in buckets}
    return {rows: kernel for rows, kernel in chosen.items() if kernel is not None}


def _check_pins(pins: Pins, linears: dict[str, list[tuple[nn.Linear, tuple[int, ...]]]]) -> None:
    """ValueError, naming the choices, for a pin this model cannot take: a kernel that does not exist, a
    layer it does not have, a bucket the layer is not planned for (the LM head stops at HEAD_MAX_ROWS),
    or a kernel that cannot hold the layer's weight here (`kernel_fits`)."""
    for name, by_rows in pins.items():
        unknown = sorted(set(by_rows.values()) - set(KERNELS))
        if unknown:
            raise ValueError(f"linear kernels: unknown kernel {unknown[0]!r}; the kernels: {', '.join(KERNELS)}")
        if name != "*" and name not in linears:
            raise ValueError(f"linear kernels: this model has no linear named {name!r}; its linears: "
                             f"{', '.join(linears)} (or * for all)")
        if name != "*":
            missing = sorted(set(by_rows) - {None, *linears[name][0][1]})
            if missing:
                raise ValueError(f"linear kernels: {name} is planned for {missing[0]} rows never; its buckets: "
                                 f"{', '.join(map(str, linears[name][0][1]))} (the last takes larger batches)")
    for name, members in linears.items():
        for linear, buckets in members:
            for rows, kernel in _pinned_buckets(pins, name, buckets).items():
                if not kernel_fits(kernel, linear.weight):
                    fitting = [k for k in KERNELS if kernel_fits(k, linear.weight)]
                    raise ValueError(
                        f"linear kernels: {kernel} cannot hold {name}'s {linear.out_features}x{linear.in_features} "
                        f"{linear.weight.dtype} weight on this machine; the kernels that can: {', '.join(fitting)}")


def lossy_linear_kernels(model: nn.Module) -> tuple[str, ...]:
    """"LAYER: KERNEL" for each kernel the model's linears run past their accuracy budget (GetEngineInfo)."""
    return tuple(sorted({f"{name.rsplit('.', 1)[-1]}: {kernel}" for name, module in model.named_modules()
                         if isinstance(module, CpuLinear) for kernel in module.lossy_kernels}))


_CALIBRATION_OUTPUTS = 512  # outputs of a weight the accuracy verdict runs (a slice stands for the rest)


def accuracy_verdict(weight: torch.Tensor, bias: torch.Tensor | None, kernels: tuple[str, ...],
                     role: LinearRole) -> AccuracyVerdict:
    """Each of `kernels` measured against this layer's accuracy budget (kernels/cpu/accuracy_budget.py), on
    the first outputs of its weight."""
    weight = weight.detach()[:_CALIBRATION_OUTPUTS]
    bias = None if bias is None else bias.detach()[:_CALIBRATION_OUTPUTS]
    fits = [name for name in dict.fromkeys(kernels) if kernel_fits(name, weight)]

    def run(name: str, x: torch.Tensor) -> torch.Tensor:
        with one_thread():
            state = KERNELS[name][0](weight, bias)
        return KERNELS[name][1](state, x)
    return accuracy_budget.measure(weight, bias, fits, FLOAT_KERNELS + UNTIMED_FLOAT_KERNELS, run,
                                   outliers=role is LinearRole.OUTLIER_INPUT)


def auto_kernels(weights: list[torch.Tensor], bias: torch.Tensor | None, role: LinearRole) -> tuple[str, ...]:
    """The kernels `auto` may time for a group of same-shape weights in `role`: those that fit, within the
    first weight's accuracy budget."""
    with one_thread():
        kernels = _kernels_for("auto", weights, role)
    return _within(kernels, accuracy_verdict(weights[0], bias, kernels, role))


def _within(kernels: tuple[str, ...], verdict: AccuracyVerdict) -> tuple[str, ...]:
    """The kernels within the verdict's budget (the float ones always are, so never none in auto)."""
    return tuple(name for name in kernels if verdict.within(name)) or kernels


@torch.no_grad()
def use_measured_linears(model: nn.Module, quantization: str = "none", buckets: tuple[int, ...] = BUCKETS,
                         timer: Timer | None = None, roles: Mapping[str, LinearRole] | None = None,
                         pins: Pins | None = None) -> dict[tuple[int, int], Plan]:
    """Replace every `nn.Linear` in `model` (on CPU) by a `CpuLinear` whose kernel per batch
    bucket was measured fastest on this machine among those `quantization` allows for its role
    (`roles`: the model's, by attribute name; any other linear is LinearRole.ANY), or pinned by `pins`
    (any kernel that holds the weight, whatever `quantization` and the role allow; ValueError else).

    Same-shape layers share one measurement, kept on disk for the next load on this machine
    (kernels/cpu/linear_plan_cache.py; not with an injected `timer`); pinned buckets are neither timed nor
    stored. Logs one line per shape and returns the plans.
    """
    allowed_kernels(quantization)  # validates the name
    pins = pins or {}
    cached = timer is None and _wall_timer is linear_timing.wall_timer
    groups: dict[tuple, list[tuple[nn.Module, str, nn.Linear]]] = {}
    by_name: dict[str, list[tuple[nn.Linear, tuple[int, ...]]]] = {}
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                role = (roles or {}).get(child_name, LinearRole.ANY)
                pinned = _pinned_buckets(pins, child_name, _buckets_for(role, buckets))
                key = (child.out_features, child.in_features, child.bias is not None, role, tuple(pinned.items()))
                groups.setdefault(key, []).append((parent, child_name, child))
                by_name.setdefault(child_name, []).append((child, _buckets_for(role, buckets)))
    _check_pins(pins, by_name)
    plans = {}
    for (out_f, in_f, _, role, pinned_items), members in groups.items():
        pinned = dict(pinned_items)
        timed_buckets = tuple(b for b in _buckets_for(role, buckets) if b not in pinned)
        plan, states, count, described, note = [], {}, 0, [], ""
        first = members[0][2]
        kernels: tuple[str, ...] = ()
        if timed_buckets:
            with one_thread():
                kernels = _kernels_for(quantization, [m.weight for _, _, m in members], role)
        verdict = accuracy_verdict(first.weight, first.bias, (*kernels, *pinned.values()), role)
        if timed_buckets:
            weight_bytes = out_f * in_f * first.weight.element_size()
            count = max(1, min(len(members), _TIMING_BYTES // max(weight_bytes, 1)))
            sample = [(m.weight, m.bias) for _, _, m in members[:count]]
            if quantization == "auto":  # lossier kernels are the user's to ask for (--quantization)
                kernels = _within(kernels, verdict)
            entry = (f"linear {out_f}x{in_f} bias={members[0][2].bias is not None} role={role.value} "
                     f"{members[0][2].weight.dtype} kernels={','.join(kernels)} buckets={timed_buckets}")
            stored = linear_plan_cache.lookup(entry) if cached else None
            if stored is not None and all(name in kernels for _, name in stored):
                plan, count = [(rows, name) for rows, name in stored], 0
                described, note = [f"{rows}:{name}" for rows, name in plan], " (measured on an earlier load)"
            else:
                with one_thread():
                    states = {name: [KERNELS[name][0](w, b) for w, b in sample] for name in kernels}
                plan, timings, races = choose_plan(sample, kernels, timed_buckets, timer or _wall_timer, states)
                described = [f"{rows}:{name}({timings[rows][name] * 1e6:.0f}us)" for rows, name in plan]
                if cached:
                    linear_plan_cache.keep(entry, plan, races.values())
        plan = sorted(plan + list(pinned.items()))
        described = sorted(described + [f"{rows}:{name}(pinned)" for rows, name in pinned.items()],
                           key=lambda text: int(text.partition(":")[0]))
        with one_thread():
            for i, (parent, child_name, child) in enumerate(members):
                prepared = {name: states[name][i] for name in states} if i < count else None
                linear = CpuLinear(child.weight, child.bias, plan, prepared, pinned)
                linear.accuracy = verdict
                setattr(parent, child_name, linear)
        plans[(out_f, in_f)] = plan
        logger.info("linear %dx%d %s (x%d): %s%s; accuracy: %s", out_f, in_f,
                    ",".join(dict.fromkeys(n for _, n, _ in members)), len(members), ", ".join(described), note,
                    verdict.describe(dict.fromkeys(name for _, name in plan)))
        lossy = [name for name in dict.fromkeys(name for _, name in plan) if not verdict.within(name)]
        if lossy:
            logger.warning("linear %dx%d runs %s, past its accuracy budget (%s): asked for with --quantization or "
                           "--linear-kernels", out_f, in_f, ", ".join(lossy), verdict.describe(lossy))
    return plans
