"""The end-of-run table and the JSON results file."""

from __future__ import annotations

import json
import math
from pathlib import Path

_COLUMNS = (  # header, path into a summary, format
    ("req/s", ("request_throughput",), "{:.2f}"),
    ("out tok/s", ("output_token_throughput",), "{:.1f}"),
    ("TTFT p50", ("ttft", "p50_ms"), "{:.0f}"),
    ("TTFT p99", ("ttft", "p99_ms"), "{:.0f}"),
    ("ITL p50", ("itl", "p50_ms"), "{:.1f}"),
    ("TPOT p50", ("tpot", "p50_ms"), "{:.1f}"),
    ("e2e p50", ("e2e", "p50_ms"), "{:.0f}"),
    ("e2e p99", ("e2e", "p99_ms"), "{:.0f}"),
)


def lookup(summary: dict, path: tuple[str, ...]):
    for key in path:
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def format_table(rows: list[tuple[str, dict]], label: str) -> str:
    """One line per (label value, summary); latencies in ms; failures and their codes at the end."""
    headers = [label, *(c[0] for c in _COLUMNS), "ok", "errors"]
    lines = []
    for name, summary in rows:
        cells = [name]
        for _, path, fmt in _COLUMNS:
            value = lookup(summary, path)
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            cells.append("-" if missing else fmt.format(value))
        cells.append(f"{summary['completed']}/{summary['requests']}")
        cells.append(", ".join(f"{code} x{n}" for code, n in summary["errors"].items()) or "-")
        lines.append(cells)
    widths = [max(len(str(row[i])) for row in [headers, *lines]) for i in range(len(headers))]
    out = [" | ".join(h.rjust(w) for h, w in zip(headers, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in lines]
    return "\n".join(out) + "\n(latencies in ms)"


def write_json(path: str | Path, result: dict) -> Path:
    """Write strict JSON (no NaN), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return path
