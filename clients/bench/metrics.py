"""Per-request timing records and their summary: TTFT, ITL, TPOT, e2e percentiles, throughput, errors.

Definitions (as in vLLM's serving benchmark): TTFT is the time from sending a request to its
first generated token; ITL the gap between consecutive streamed messages that carry tokens;
TPOT (e2e - TTFT) / (output tokens - 1); throughput counts over the wall time of the run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request: when it started, when each token-carrying message arrived, how it ended."""

    start: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival time of each message with tokens
    end: float | None = None
    error: str | None = None  # a gRPC status code name (or an exception's class name)

    def add_tokens(self, count: int, now: float) -> None:
        if count > 0:
            self.output_tokens += count
            self.chunk_times.append(now)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.end is not None else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default method)."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values: JSON has no NaN)."""
    ordered = sorted(v * 1000 for v in values)
    if not ordered:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    result = {"mean_ms": sum(ordered) / len(ordered)}
    result.update({f"p{p}_ms": percentile(ordered, p) for p in PERCENTILES})
    return result


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """The summary of one run: counts, errors by code, throughput and latency distributions."""
    done = [r for r in records if r.ok]
    wall_s = max(wall_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(Counter(r.error or "INCOMPLETE" for r in records if not r.ok)),
        "duration_s": wall_s,
        "request_throughput": len(done) / wall_s,
        "output_token_throughput": output_tokens / wall_s,
        "total_token_throughput": (output_tokens + prompt_tokens) / wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft": distribution([r.ttft for r in done if r.ttft is not None]),
        "itl": distribution([gap for r in done for gap in r.itls]),
        "tpot": distribution([r.tpot for r in done if r.tpot is not None]),
        "e2e": distribution([r.e2e for r in done]),
    }
