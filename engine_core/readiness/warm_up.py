"""The warm-up an engine runs before its owner says it serves: dummy requests through the real scheduler, runner
and sampler at the shapes a step will meet, so that no kernel compiles and no plan is timed after ready
(docs/gpu.md#ready-means-warm; engine_core/readiness/compile_monitor.py counts any that still do).

What runs, each phase to the end before the next:
- lone prompts of 1, 2, 16, 17, 100 and 128 tokens, a full step's budget, and one past it (chunked, its second
  chunk reading the first's context): Triton specializes an integer argument equal to 1 or divisible by 16, and
  the CPU linears run another kernel per row bucket;
- a prompt again behind a cached prefix (the prefix cache's hit path);
- a decode running beside another request's prefill (a mixed step);
- B requests at once, prefilled together and then decoded, for every decode batch size B the engine captured as a
  CUDA graph (on the CPU the linears' row buckets up to max_num_seqs);
- one batch through every sampler path: greedy with logprobs and prompt logprobs, temperature with top-k, top-p
  and min-p, a seed, penalties with min_tokens and a logit bias, and a grammar when the engine has a vocabulary
  for structured output, and an adapter when one is loaded.

It leaves no trace: its requests (ids starting `__warmup-`) all finish, every block is free again, the prefix
cache is reset with its KV events dropped, its grammar is dropped from the grammar cache (the vocabulary stays
built), the scheduler's step counters read zero and torch's random state is as it was. Its steps never reach a
busy loop, so no metric counts them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine_core.protocol import EngineCoreRequest, SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from engine_core.engine_core import EngineCore

logger = logging.getLogger(__name__)

REQUEST_ID_PREFIX = "__warmup-"  # no caller's id collides: the busy loop gives requests engine ids of its own
LONE_PROMPT_LENGTHS = (1, 2, 16, 17, 100, 128)
CPU_DECODE_BATCH_SIZES = (1, 2, 8, 32, 128)  # the CPU linears' row buckets (kernels/cpu/linear.py), and 2
BATCH_PROMPT_LENGTH = 2  # more than one token: the batch's prefill is not a decode-shaped step
MAX_STEPS_PER_PHASE = 10_000  # a phase that runs longer is a bug, not a slow machine
WARM_UP_GRAMMAR = StructuredOutput(choice=("yes", "no"))  # builds the vocabulary; its grammar is forgotten after


@dataclass(frozen=True)
class WarmUpReport:
    """What `warm_up` ran, for its log line and tests."""

    steps: int
    requests: int
    prompt_lengths: tuple[int, ...]
    decode_batch_sizes: tuple[int, ...]
    sampler_paths: tuple[str, ...]
    seconds: float

    def describe(self) -> str:
        def listed(values: tuple) -> str:
            return ", ".join(map(str, values)) or "none"

        return (f"{self.requests} requests in {self.steps} steps: prompts of {listed(self.prompt_lengths)} tokens, "
                f"decode batches of {listed(self.decode_batch_sizes)}, sampler {listed(self.sampler_paths)}")


def warm_up(core: EngineCore) -> WarmUpReport:
    """Run the phases above on `core`, which must have no request in flight; returns what ran."""
    if core.has_unfinished_requests():
        raise RuntimeError("warm_up runs before an engine serves: this one has requests in flight")
    started = time.perf_counter()
    rng_state = torch.get_rng_state()
    cuda_rng_state = torch.cuda.get_rng_state() if core.runner.device.type == "cuda" else None
    run = _Run(core)
    lengths = prompt_lengths(core)
    for length in lengths:
        run.requests([run.prompt(length)])
    run.prefix_hit()
    run.mixed_step()
    sizes = decode_batch_sizes(core)
    for size in sizes:
        run.requests([run.prompt(BATCH_PROMPT_LENGTH) for _ in range(size)], max_tokens=3)
    paths = run.sampler_paths()
    run.leave_no_trace()
    torch.set_rng_state(rng_state)
    if cuda_rng_state is not None:
        torch.cuda.set_rng_state(cuda_rng_state)
    report = WarmUpReport(run.steps, run.count, tuple(lengths), tuple(sizes), paths, time.perf_counter() - started)
    logger.info("warm-up: %s, in %.2f s", report.describe(), report.seconds)
    return report


def runs_triton_interpreted(attention_backend: str) -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, tests only) compiles nothing: a warm-up there would warm
    nothing and run a hundred requests through the interpreter, so the engine is ready without one."""
    return attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"


def prompt_lengths(core: EngineCore) -> list[int]:
    """The lone prompts' lengths: LONE_PROMPT_LENGTHS, the step's budget and one past it, those that fit."""
    budget = core.config.scheduler.max_num_batched_tokens
    longest = core.max_model_len - 4  # room for the tokens it generates
    return sorted({n for n in (*LONE_PROMPT_LENGTHS, budget, budget + 17) if n <= longest})


def decode_batch_sizes(core: EngineCore) -> list[int]:
    """Every CUDA-graph bucket (and max_num_seqs when eager steps run above the largest); on the CPU the linears'
    row buckets. Each fits the KV cache with its blocks to spare."""
    max_num_seqs = core.config.scheduler.max_num_seqs
    graphs = core.runner.decode_graphs
    sizes = set(graphs.sizes) | {max_num_seqs} if graphs is not None else set(CPU_DECODE_BATCH_SIZES) | {max_num_seqs}
    block_size = core.config.cache.block_size
    blocks_per_request = -(-(BATCH_PROMPT_LENGTH + 3) // block_size)
    fits = (core.scheduler.kv_cache_manager.num_blocks - 1) // blocks_per_request
    return sorted(s for s in sizes if s <= min(max_num_seqs, fits))


class _Run:
    """The warm-up's requests and steps on one engine."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.vocab_size = core.arch.vocab_size
        self.count = 0  # requests added: each gets the next id
        self.num_prompts = 0
        self.steps = 0

    def prompt(self, length: int) -> list[int]:
        """`length` token ids unlike any other warm-up prompt's (so no prefix is shared by chance)."""
        self.num_prompts += 1
        start = self.num_prompts * 7919
        return [(start + 31 * i) % self.vocab_size for i in range(length)]

    def add(self, prompt: list[int], params: SamplingParams, lora_name: str | None = None) -> None:
        """Queue one request, its prompt and tokens cut to what a short max_model_len holds."""
        prompt = prompt[:self.core.max_model_len - 1]
        self.core.add_request(EngineCoreRequest(f"{REQUEST_ID_PREFIX}{self.count}", prompt,
                                                replace(params, clamp_max_tokens=True), lora_name=lora_name))
        self.count += 1

    def requests(self, prompts: list[list[int]], max_tokens: int = 2) -> None:
        for prompt in prompts:
            self.add(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        self.finish()

    def finish(self) -> None:
        """Step until every warm-up request is done."""
        for _ in range(MAX_STEPS_PER_PHASE):
            if not self.core.has_unfinished_requests():
                return
            self.core.step()
            self.steps += 1
        raise RuntimeError(f"the warm-up's requests did not finish in {MAX_STEPS_PER_PHASE} steps")

    def prefix_hit(self) -> None:
        """A prompt, then another behind its full blocks: the second prefill reads a cached context."""
        block_size = self.core.config.cache.block_size
        shared = self.prompt(2 * block_size)
        if len(shared) + 5 >= self.core.max_model_len:
            return
        self.requests([shared + [1, 2, 3]])
        self.requests([shared + [3, 2, 1]])

    def mixed_step(self) -> None:
        """A decode beside another request's prefill in one step."""
        self.add(self.prompt(3), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        self.core.step()
        self.steps += 1
        length = max(1, min(33, self.core.max_model_len - 4))
        self.add(self.prompt(length), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        self.finish()

    def sampler_paths(self) -> tuple[str, ...]:
        """One batch through every sampler path this engine has; returns their names."""
        some_token = self.num_prompts % self.vocab_size
        paths = {
            "greedy with logprobs": SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=3),
            "top-k/top-p/min-p": SamplingParams(temperature=0.8, top_k=min(20, self.vocab_size), top_p=0.9,
                                                min_p=0.05),
            "seeded": SamplingParams(temperature=1.0, seed=0),
            "penalties": SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5,
                                        repetition_penalty=1.2, min_tokens=2, logit_bias={some_token: 1.0}),
        }
        for params in paths.values():
            self.add(self.prompt(5), replace(params, max_tokens=3, ignore_eos=True))
        names = list(paths)
        if self.core.structured.tokenizer_path is not None:  # the vocabulary is built now, not on a user's request
            try:
                self.add(self.prompt(5), SamplingParams(temperature=0.0, max_tokens=3, structured=WARM_UP_GRAMMAR))
                names.append("grammar")
            except ValueError as error:  # a vocabulary llguidance refuses: structured requests will say so too
                logger.warning("warm-up: the grammar path is not warmed: %s", error)
        adapters = self.core.list_loras()
        if adapters:
            self.add(self.prompt(5), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     lora_name=adapters[0].name)
            names.append(f"adapter {adapters[0].name}")
        self.finish()
        return tuple(names)

    def leave_no_trace(self) -> None:
        """Every block free, the prefix cache empty and unreported, the step's counters at zero."""
        core = self.core
        core.step()  # an empty step: takes the finished ids (the runner forgets their state) and zeroes the counters
        manager = core.scheduler.kv_cache_manager
        if manager.num_free_blocks != manager.num_blocks - 1 or not core.reset_prefix_cache():
            raise RuntimeError(f"the warm-up left {manager.num_blocks - 1 - manager.num_free_blocks} KV blocks "
                               "owned: a block leak in the engine's bookkeeping")
        core.take_kv_events()  # the reset's report: nobody has heard of the warm-up's blocks
        core.structured.forget(WARM_UP_GRAMMAR)  # the grammar cache holds users' grammars only
        core.last_mask_timing = None
