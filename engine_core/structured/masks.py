"""The engine's structured outputs: grammars compiled once per text, a matcher per request, and each
step's token masks, computed on a worker thread while the forward pass runs.

llguidance computes a step's masks for all constrained rows in parallel (its LLExecutor, which
drops the GIL), on the worker thread beside the forward; the sampler waits only for what is left
(`MaskTiming.wait_seconds`). On a GPU the CPU is idle during the forward; on a CPU whose cores
torch uses, the worker still fills the gaps its thread team leaves while the main thread runs
Python between ops, so masks beside the forward cost less throughput than after it
(docs/structured-output.md#how-it-works). torch-free: the masks are numpy.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from engine_core.protocol import StructuredOutput
from engine_core.protocol.structured_output import grammar_text
from engine_core.structured.matcher import GrammarMatcher
from engine_core.structured.vocabulary import build_vocabulary

if TYPE_CHECKING:
    from engine_core.request import Request

logger = logging.getLogger(__name__)

DEFAULT_GRAMMAR_CACHE_SIZE = 256


@dataclass(frozen=True)
class MaskTiming:
    """One step's masks: engine-local, for the `tandem:structured_mask_*` metrics."""

    compute_seconds: float  # computing every constrained row's mask (on the worker thread)
    wait_seconds: float  # the sampler waiting for them after the forward: the part not hidden
    num_rows: int  # constrained rows this step


class StepMasks:
    """A step's masks in the making: `rows` are the sampling rows (batch order) that are constrained.
    Either already running on the worker thread (`future`) or computed when asked for (`compute`)."""

    def __init__(self, rows: list[int], future: Future | None = None,
                 compute: Callable[[], tuple[np.ndarray, float]] | None = None) -> None:
        self.rows = rows
        self._future = future
        self._compute = compute

    def result(self) -> tuple[np.ndarray, MaskTiming]:
        """[len(rows), V] uint8, 1 where a token is NOT allowed (`disallowed_tokens`), and the timing."""
        started = time.perf_counter()
        disallowed, compute_seconds = self._future.result() if self._future is not None else self._compute()
        return disallowed, MaskTiming(compute_seconds, time.perf_counter() - started, len(self.rows))


class StructuredOutputs:
    """Owned by the engine: compiles constraints into matchers and computes the masks of a batch."""

    def __init__(self, tokenizer_path: str | None, *, vocab_size: int, eos_token_ids: list[int],
                 overlap: bool = True, num_threads: int | None = None,
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE) -> None:
        """`tokenizer_path`: a .gguf or a folder with tokenizer.json (None: structured requests are refused).
        `overlap`: compute masks on a worker thread during the forward (False: when the sampler asks,
        after it). `num_threads`: llguidance's (None: its default)."""
        self.tokenizer_path = tokenizer_path
        self.overlap = overlap
        self.num_threads = num_threads
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._vocabulary: LLTokenizer | None = None
        self._json_vocabulary: LLTokenizer | None = None  # the same, with llguidance's JSON slices
        self._grammars: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar text -> compiled, fresh
        self._cache_size = cache_size
        self._executor: LLExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None

    # ---- compile ------------------------------------------------------------------
    @property
    def vocabulary(self) -> LLTokenizer:
        """Built on the first structured request (under a second for a 50k vocabulary), then kept."""
        if self._vocabulary is None:
            if self.tokenizer_path is None:
                raise ValueError("structured output needs the model's tokenizer, and this engine has none: start "
                                 "it with --tokenizer (a tokenizer.json folder or a .gguf)")
            self._vocabulary = build_vocabulary(self.tokenizer_path, vocab_size=self.vocab_size,
                                                eos_token_ids=self.eos_token_ids)
        return self._vocabulary

    def vocabulary_for(self, kind: str) -> LLTokenizer:
        """JSON constraints get llguidance's JSON token slices (about a third less mask time on JSON
        than the general slices); the others the general ones."""
        if kind not in ("json_schema", "json_object"):
            return self.vocabulary
        if self._json_vocabulary is None:
            self._json_vocabulary = self.vocabulary.with_slices(LLTokenizer.json_slices())
        return self._json_vocabulary

    def new_matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for a checked constraint; ValueError with llguidance's message if it does not compile."""
        text = grammar_text(structured)
        compiled = self._grammars.get(text)
        if compiled is None:
            compiled = LLMatcher(self.vocabulary_for(structured.kind), text, log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured.{structured.kind} does not compile: {compiled.get_error()}")
            self._grammars[text] = compiled
            if len(self._grammars) > self._cache_size:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(text)
        return GrammarMatcher(compiled.deep_copy(), structured.kind)

    def forget(self, structured: StructuredOutput) -> None:
        """Drop this constraint's compiled grammar from the cache (the vocabulary stays built)."""
        self._grammars.pop(grammar_text(structured), None)

    @property
    def num_cached_grammars(self) -> int:
        return len(self._grammars)

    # ---- masks --------------------------------------------------------------------
    def start_masks(self, requests: list[Request]) -> StepMasks | None:
        """Begin this step's masks for the constrained ones among `requests` (the sampling rows, in
        order) on the worker thread; None when none is constrained. The matchers must not advance
        until `result()` has returned."""
        rows = [row for row, request in enumerate(requests) if request.grammar is not None]
        if not rows:
            return None
        if self._executor is None:
            self._executor = LLExecutor(self.num_threads)
        constrained = [requests[row] for row in rows]
        if not self.overlap:
            return StepMasks(rows, compute=lambda: self._compute(constrained))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-masks")
        return StepMasks(rows, future=self._worker.submit(self._compute, constrained))

    def _compute(self, requests: list[Request]) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        bitmask = allocate_token_bitmask(len(requests), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(r.grammar.matcher, i) for i, r in enumerate(requests)],
                                    bitmask)
        for i, request in enumerate(requests):
            if request.num_output_tokens < request.sampling_params.min_tokens:
                _ban_ends(bitmask[i], request)
        return disallowed_tokens(bitmask, self.vocab_size), time.perf_counter() - started


def disallowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """llguidance's [R, ceil(V / 32)] int32 bitmask (bit t: token t allowed) -> [R, V] uint8, 1 = not allowed.

    Unpacked here, on the worker thread, so that the sampler's part is one masked_fill over a
    zero-copy bool view. Little-endian words: byte-wise, lowest bit first, bit index == token id.
    """
    return np.unpackbits(~bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")


def _ban_ends(row: np.ndarray, request: Request) -> None:
    """min_tokens under a grammar: no EOS or stop token yet, unless the grammar allows nothing else
    (a finished structure ends the request whatever min_tokens says)."""
    params = request.sampling_params
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
    ends = [t for t in ends if t < row.size * 32]
    if not ends:
        return
    words = np.array([t // 32 for t in ends])
    bits = np.array([1 << (t % 32) for t in ends], dtype=np.int64).astype(np.uint32).view(np.int32)
    before = row.copy()
    np.bitwise_and.at(row, words, ~bits)
    if not row.any():
        row[:] = before
