"""Run the engine and kernel tests under other CPU dispatch settings (`make test-portability`).

Users' CPUs differ (Intel with AMX, Intel without bf16, AMD with AVX512-BF16, AVX2-only boxes),
and so do the kernels torch, MKL and oneDNN pick on each. A test that holds only with one
machine's kernels (bitwise-equal floats across different batch shapes, say) passes CI on the
developer's kind of machine and fails on the next. This runs the same tests with each library
forced onto other code paths and prints one row per setting; it exits 1 if any setting fails.

    python scripts/test_portability.py                        # every setting below
    python scripts/test_portability.py --settings aten-avx2,one-thread -- -x   # pytest args after --

Writes bench_results/portability.json (setting, environment, counts, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tests whose numbers depend on the CPU's kernels: the model, the engine, the attention kernels,
# and the SmolLM2 answers in fp32 and in dtype=auto (bf16 where the CPU has it)
TESTS = ["tests/engine_core", "tests/kernels", "tests/test_default_model.py"]

SETTINGS: dict[str, dict[str, str]] = {
    "native": {},  # whatever this CPU picks
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},  # ATen's scalar (non-vectorized) kernels
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},  # ATen's AVX2 kernels
    # an AVX2-only machine for all three libraries: no AVX-512, no native bf16 (oneDNN emulates it)
    "avx2-machine": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},  # MKL's conservative code path: other GEMM summation order
    "one-thread": {"OMP_NUM_THREADS": "1"},  # other parallel splits of every reduction
}
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def run_setting(name: str, env: dict[str, str], pytest_args: list[str]) -> dict:
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *pytest_args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _COUNT.findall(summary)}
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"setting": name, "env": env, "returncode": proc.returncode, "counts": counts,
            "seconds": round(time.perf_counter() - started, 1), "failures": failed,
            "tail": "" if proc.returncode == 0 else proc.stdout[-4000:] + proc.stderr[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, from: {', '.join(SETTINGS)}")
    parser.add_argument("--json", type=Path, default=ROOT / "bench_results" / "portability.json",
                        help="where to write the results")
    args, pytest_args = parser.parse_known_args()
    pytest_args = [a for a in pytest_args if a != "--"]
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")

    results = []
    print(f"{'setting':<16} {'passed':>6} {'failed':>6} {'skipped':>7} {'seconds':>8}  environment", flush=True)
    for name in names:
        result = run_setting(name, SETTINGS[name], pytest_args)
        results.append(result)
        c = result["counts"]
        env = " ".join(f"{k}={v}" for k, v in result["env"].items()) or "(none)"
        failed = c.get("failed", 0) + c.get("error", 0)
        print(f"{name:<16} {c.get('passed', 0):>6} {failed:>6} {c.get('skipped', 0):>7} {result['seconds']:>8}  {env}",
              flush=True)
        for line in result["failures"]:
            print(f"    {line}")
        if result["returncode"] not in (0,) and not result["failures"]:
            print(result["tail"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tests": TESTS, "results": results}, indent=2))
    print(f"wrote {args.json}")
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
