"""The engine's host work per decode step, by part, with a model that does nothing.

A real EngineCore (scheduler, KV cache manager, model runner's input preparation, sampling
metadata, sampler, structured-output masks, output building) steps B decoding requests; only
the model is swapped for one whose forward and logits cost nothing (a preallocated buffer), so
what is left is what a GPU would wait on between its forwards. SmolLM2-135M's shapes and
tokenizer (for the masks), greedy sampling, fp32, CPU.

    .venv/bin/python scripts/bench_host_overhead.py                  # batch 1, 32, 256; masks off and on
    .venv/bin/python scripts/bench_host_overhead.py --batch 32 --steps 200 --json out.json

Parts (ms per step, median over the timed steps): schedule, prepare (the runner's input tensors),
forward and logits (the no-op model: ~0), masks (starting the step's grammar masks, the sampler
waiting for them and applying them), sampling metadata, argmax (the greedy sampler's kernel over
the vocabulary: device work on a GPU), sampler (the rest of the sampler), update (tokens
appended, stop checks, outputs built), other (the rest of step(): timestamps, KV events, the runner's bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_core.openmp_env import limit_openmp_spinning  # noqa: E402

limit_openmp_spinning()  # before torch loads, as tandem-engine does: idle OpenMP threads must not spin

import torch  # noqa: E402

from engine_core.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelArchConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine_core.engine_core import EngineCore  # noqa: E402
from engine_core.loader.registry import default_model_path  # noqa: E402
from engine_core.protocol import EngineCoreRequest, SamplingParams, StructuredOutput  # noqa: E402
from engine_core.runner import model_runner as model_runner_module  # noqa: E402
from engine_core.runner import sampler as sampler_module  # noqa: E402
from engine_core.structured.masks import StepMasks, StructuredOutputs  # noqa: E402

# SmolLM2-135M, with one layer: only the KV cache's size depends on the layer count here.
SMOLLM2_SHAPES = ModelArchConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
    bos_token_id=1, eos_token_ids=(2,),
)
PROMPT_LEN = 32
PARTS = ("schedule", "prepare", "forward", "logits", "masks", "metadata", "argmax", "sampler", "update", "other")
DEVICE_PARTS = ("forward", "logits", "argmax")  # kernels on a GPU: not host work there
# The no-op logits peak at this token ("a" in SmolLM2's vocabulary): a lowercase letter, so the
# regex below always allows it and a constrained step does the same work every time.
PEAK_TOKEN = 81
ALWAYS_OPEN_REGEX = "[a-z ]*"


class NoOpModel(torch.nn.Module):
    """Forward and logits from preallocated buffers: the model's cost taken out of the step."""

    def __init__(self, arch: ModelArchConfig, max_tokens: int, max_rows: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_tokens, arch.hidden_size)
        self.logits = torch.zeros(max_rows, arch.vocab_size)
        self.logits[:, PEAK_TOKEN] = 1.0

    def forward(self, input_ids, positions, kv_caches, attn_metadata):  # noqa: ANN001 - the model's signature
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # a view: the masks write -inf into it in place, the same tokens every step (ALWAYS_OPEN_REGEX)
        return self.logits[: hidden.shape[0]]


class PartTimer:
    """Wraps callables so each call's wall time adds to its part of the current step; a part called
    inside another (the argmax inside the sampler) counts only for itself."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []

    def wrap(self, part: str, fn):  # noqa: ANN001, ANN201
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self._stack.append(part)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self._stack.pop()
                self.current[part] += elapsed
                if self._stack:
                    self.current[self._stack[-1]] -= elapsed
        return timed

    def take(self) -> dict[str, float]:
        step, self.current = self.current, defaultdict(float)
        return step


def build_engine(batch: int, overlap: str) -> EngineCore:
    max_len = PROMPT_LEN + 2048
    blocks_per_request = -(-max_len // 16)
    config = EngineConfig(
        model=ModelConfig(model=str(default_model_path()), dtype="float32", quantization="none",
                          max_model_len=max_len),
        cache=CacheConfig(num_blocks=batch * blocks_per_request + 1, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(batch * PROMPT_LEN, 2048)),
        device=DeviceConfig(device="cpu", attention_backend="torch", enforce_eager=True),
    )
    if overlap != "default":
        config.device.overlap = overlap  # type: ignore[attr-defined]
    model = NoOpModel(SMOLLM2_SHAPES, max_tokens=batch * PROMPT_LEN + batch, max_rows=batch)
    with mock.patch("engine_core.startup.load_model", return_value=(model, SMOLLM2_SHAPES)), \
            mock.patch("engine_core.startup.prepare_for_cpu"):  # no layers to choose kernels for
        return EngineCore(config)


def run(batch: int, steps: int, masks: bool, overlap: str = "default") -> dict:
    engine = build_engine(batch, overlap)
    timer = PartTimer()
    runner, scheduler = engine.runner, engine.scheduler
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    scheduler.update_from_output = timer.wrap("update", scheduler.update_from_output)
    runner._prepare_batch = timer.wrap("prepare", runner._prepare_batch)
    runner.model.forward = timer.wrap("forward", runner.model.forward)
    runner.model.compute_logits = timer.wrap("logits", runner.model.compute_logits)
    if hasattr(runner.sampler, "sample"):  # the sampler's tensor-returning entry point
        runner.sampler.sample = timer.wrap("sampler", runner.sampler.sample)
    else:
        runner.sampler = timer.wrap("sampler", runner.sampler)
    patches = [
        mock.patch.object(model_runner_module, "build_sampling_metadata",
                          timer.wrap("metadata", model_runner_module.build_sampling_metadata)),
        mock.patch.object(model_runner_module, "apply_token_mask",
                          timer.wrap("masks", model_runner_module.apply_token_mask)),
        mock.patch.object(sampler_module, "argmax", timer.wrap("argmax", sampler_module.argmax)),
        mock.patch.object(StepMasks, "result", timer.wrap("masks", StepMasks.result)),
        mock.patch.object(StructuredOutputs, "start_masks", timer.wrap("masks", StructuredOutputs.start_masks)),
    ]
    structured = StructuredOutput(regex=ALWAYS_OPEN_REGEX) if masks else None
    warmup = 8
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 4, ignore_eos=True, structured=structured)
    generator = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(100, SMOLLM2_SHAPES.vocab_size, (PROMPT_LEN,), generator=generator).tolist()
        engine.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    totals, per_part = [], defaultdict(list)
    for patch in patches:
        patch.start()
    try:
        for step in range(warmup + steps):
            started = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - started
            parts = timer.take()
            if step < warmup:  # the prefill and the first decodes (masks' first compile, caches)
                continue
            totals.append(elapsed)
            for part in PARTS[:-1]:
                per_part[part].append(parts.get(part, 0.0))
            per_part["other"].append(elapsed - sum(parts.values()))
    finally:
        for patch in patches:
            patch.stop()
    assert engine.get_num_unfinished_requests() == batch, "every request must still be decoding"
    engine.abort_requests([f"r{i}" for i in range(batch)])
    if engine.has_unfinished_requests():
        engine.step()
    median_ms = {part: statistics.median(values) * 1e3 for part, values in per_part.items()}
    host = [total - sum(per_part[p][i] for p in DEVICE_PARTS) for i, total in enumerate(totals)]
    return {"batch": batch, "masks": masks, "overlap": overlap, "steps": steps,
            "step_ms": statistics.median(totals) * 1e3, "host_ms": statistics.median(host) * 1e3,
            "parts_ms": median_ms}


def print_table(results: list[dict]) -> None:
    print(f"{'batch':>5} {'masks':>5} {'step ms':>8} {'host ms':>8} " + " ".join(f"{p:>8}" for p in PARTS))
    for r in results:
        parts = " ".join(f"{r['parts_ms'].get(p, 0.0):8.3f}" for p in PARTS)
        print(f"{r['batch']:>5} {'on' if r['masks'] else 'off':>5} {r['step_ms']:8.3f} {r['host_ms']:8.3f} {parts}")
    print("host ms = step ms less forward, logits and argmax (device kernels on a GPU); medians over the steps")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 32, 256)")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per case (default 100)")
    parser.add_argument("--masks", choices=("off", "on", "both"), default="both")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host work is one thread; keep torch's ops from spreading
    masks = {"off": [False], "on": [True], "both": [False, True]}[args.masks]
    results = [run(batch, args.steps, m) for batch in (args.batch or [1, 32, 256]) for m in masks]
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
