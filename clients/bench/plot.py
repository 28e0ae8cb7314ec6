"""A PNG of a sweep: latency and throughput against concurrency or request rate (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

_LATENCIES = (  # metric, percentile, label, line style, colour (one per metric)
    ("ttft", "p50_ms", "TTFT p50", "o-", "C0"), ("ttft", "p99_ms", "TTFT p99", "o--", "C0"),
    ("tpot", "p50_ms", "TPOT p50", "^-", "C2"),
    ("e2e", "p50_ms", "e2e p50", "s:", "C3"), ("e2e", "p99_ms", "e2e p99", "s-.", "C3"),
)


def plot_sweep(series: dict[str, list[dict]], x_key: str, path: str | Path, title: str) -> Path:
    """`series`: name -> sweep points (each has `x_key` and metrics.summarize's fields). Left panel:
    latency percentiles (log scale); right panel: output tokens/s (and requests/s for one series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(12, 4.5))
    several = len(series) > 1
    for index, (name, points) in enumerate(series.items()):
        xs = [p[x_key] for p in points]
        prefix = f"{name} " if several else ""
        for metric, pct, label, style, color in _LATENCIES:
            if several and pct != "p50_ms" or several and metric == "tpot":
                continue  # several backends: TTFT and e2e medians only, one colour per backend
            ys = [p[metric][pct] for p in points]
            if any(y is not None for y in ys):
                latency.plot(xs, [float("nan") if y is None else y for y in ys], style, label=prefix + label,
                             color=f"C{index}" if several else color)
        throughput.plot(xs, [p["output_token_throughput"] for p in points], "o-", label=prefix + "output tok/s",
                        color=f"C{index}")
        for axis in (latency, throughput):
            axis.set_xticks(xs)
    axis_label = x_key.replace("_", " ") + (" (requests/s)" if x_key == "rate" else " (requests in flight)")
    latency.set(xlabel=axis_label, ylabel="ms", title="latency", yscale="log")
    latency.legend(fontsize=7, ncol=2)
    latency.grid(True, which="both", alpha=0.3)
    throughput.set(xlabel=axis_label, ylabel="output tokens / s", title="throughput")
    throughput.grid(True, alpha=0.3)
    if not several:
        points = next(iter(series.values()))
        requests = throughput.twinx()
        requests.plot([p[x_key] for p in points], [p["request_throughput"] for p in points], "s:",
                      color="tab:orange", linewidth=1, label="requests/s")
        requests.set_ylabel("requests / s")
        requests.legend(loc="lower right", fontsize=8)
    throughput.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
