"""`make gpu-check`'s script in its CPU mode: every part runs on tiny shapes, so the script that only a GPU
machine runs for real (scripts/gpu_check.py, docs/gpu.md) cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode_runs_every_part(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["mode"] == "cpu"
    parts = result["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {name: "ok" for name in (
        "cuda_tests", "bandwidth", "attention", "smollm2", "end_to_end", "llama_shapes", "smollm2_profile",
        "transformers")}
    smollm2 = parts["smollm2"]["result"]
    assert {(r["batch"], r["context"], r["overlap"]) for r in smollm2} == {
        (b, c, o) for b, c in ((1, 32), (4, 96), (8, 48)) for o in (False, True)}
    assert all(r["tokens"] == r["batch"] * r["steps"] for r in smollm2), "every timed step yields a token per request"
    attention = parts["attention"]["result"]
    assert all(r["max_abs_diff"] < 1e-3 for r in attention["rows"])
    assert {r["kind"] for r in attention["rows"]} == {"decode", "prefill"}
    assert all(r["sdpa_ms"] > 0 for r in attention["rows"]), "every kernel timed beside SDPA"
    decodes = [r for r in attention["rows"] if r["kind"] == "decode"]
    assert all(len(r["candidates"]) == 2 for r in decodes), "every other decode launch timed on every decode shape"
    assert attention["candidates_worst_over_sdpa"]
    profile = next(r for r in parts["llama_shapes"]["result"] if "profile_eager" in r)["profile_eager"]
    assert profile["top"] and profile["kernel_ms_per_step"] > 0, "the per-kernel profile of one decode step"
    assert [c["check"] for c in result["checks"]] == [
        "attention_worst_over_sdpa", "attention_32x4096_of_bandwidth", "smollm2_1x128_step_ms",
        "smollm2_32x4096_over_roofline", "llama1b_b1_of_roofline", "llama8b_b1_of_roofline",
        "tandem_over_hf_eager_b1", "overlap_gain_b64", "end_to_end_lone_over_decode_loop",
        "end_to_end_first_over_tenth", "end_to_end_compiles_after_ready"]
    end_to_end = parts["end_to_end"]["result"]
    assert end_to_end["first_request_s"] > 0 and end_to_end["decode_loop_tok_per_s"] > 0
    assert end_to_end["compiles_after_ready"] == 0, end_to_end["compiled_after_ready"]
    assert all(c["pass"] is None for c in result["checks"]), "the bars are for the real shapes on CUDA"
    assert "check" in (tmp_path / "gpu_check.txt").read_text()
