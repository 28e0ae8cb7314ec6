"""What the fault suite did: requests run, cancelled, faults injected, blocks leaked, errors by code, peak RSS.

One FaultReport per session; tests add to it. The long run writes it as JSON
(bench_results/faults.json) and both runs print it at the end.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass
class FaultReport:
    scale: str
    requests: int = 0  # streams and unary calls made by the suite's clients
    cancelled: int = 0  # streams cancelled by a client or ended by a deadline
    faults: Counter = field(default_factory=Counter)  # injected fault kind -> count
    blocks_leaked: int = 0  # KV blocks still in use after a test's work settled
    errors: Counter = field(default_factory=Counter)  # status code name -> count (OK included)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)  # process name -> peak RSS

    def status(self, code: grpc.StatusCode) -> None:
        self.requests += 1
        self.errors[code.name] += 1

    def fault(self, kind: str, count: int = 1) -> None:
        self.faults[kind] += count

    def rss(self, process: str, mib: float | None) -> None:
        if mib is not None:
            self.peak_rss_mib[process] = max(mib, self.peak_rss_mib.get(process, 0.0))

    def as_dict(self) -> dict:
        return {
            "scale": self.scale, "requests": self.requests, "cancelled": self.cancelled,
            "faults_injected": dict(self.faults), "faults_total": sum(self.faults.values()),
            "blocks_leaked": self.blocks_leaked, "errors_by_code": dict(sorted(self.errors.items())),
            "peak_rss_mib": {k: round(v, 1) for k, v in sorted(self.peak_rss_mib.items())},
        }

    def table(self) -> str:
        d = self.as_dict()
        rows = [("scale", d["scale"]), ("requests run", d["requests"]), ("cancelled", d["cancelled"]),
                ("faults injected", f'{d["faults_total"]} {d["faults_injected"]}'),
                ("blocks leaked", d["blocks_leaked"]), ("status codes", d["errors_by_code"]),
                ("peak RSS (MiB)", d["peak_rss_mib"])]
        return "\n".join(f"  {name:<16} {value}" for name, value in rows)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
