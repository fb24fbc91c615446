"""benchmarks/gpu_check.sh dry-runs on memfit's fake CUDA runtime, so the one command a GPU machine runs is known
to work before a GPU is lent (its figures here mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"


@pytest.mark.slow  # a process that imports torch and diffusers, seven tiny generations, a tiny sweep
def test_the_gpu_check_dry_runs_on_the_fake_runtime(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--fake", "--out-dir", str(tmp_path), "--steps", "1", "--double", "1",
                           "--single", "2"], env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["bandwidth"]["pinned_bytes_per_s"] > 0
    correctness = parts["correctness"]["rows"]
    assert {(row["tiers"], row["prefetch"]) for row in correctness} == {
        (tiers, prefetch) for tiers in ("host", "disk", "host+disk") for prefetch in (True, False)}
    assert all(row["bitwise"] and row["error"] is None for row in correctness)
    rows = {row["run"]: row for row in parts["sweep"]["rows"]}
    assert not [row for row in rows.values() if "error" in row or "skipped" in row]
    streamed = [rows[f"memfit {share}% resident"]["streamed_bytes_per_forward"] for share in (100, 50, 25, 0)]
    assert streamed[0] == 0 < streamed[1] and streamed == sorted(streamed)  # three blocks: 25% and 0% stream the same
    assert rows["memfit 25% resident, from disk"]["streamed_bytes_per_forward"] == streamed[2]
    assert all(row["ratio_to_bound"] > 0 for row in rows.values())
    assert parts["profile"]["top"] and (tmp_path / parts["profile"]["trace"]).stat().st_size > 0
    assert parts["sanitizer"] == {"skipped": "needs CUDA"}
    assert "| memfit 25% resident, from disk |" in (tmp_path / "gpu_check.md").read_text()
    quantized = parts["quantized"]["rows"]  # every memfit row of each GGUF type ran and drew the resident output
    memfit_rows = [row for row in quantized if row["run"].startswith("memfit")]
    assert {row["type"] for row in memfit_rows} == {"Q8_0", "Q4_0"} and len(memfit_rows) == 12
    assert all(row["bitwise_to_memfit_resident"] and row["seconds_per_forward"] > 0 for row in memfit_rows)
    assert all(row["streamed_bytes_per_forward"] > 0 for row in memfit_rows if "100%" not in row["run"])
    assert all("needs CUDA" in row["skipped"] for row in quantized if row["run"].startswith("diffusers"))
    assert "| Q4_0 | memfit 25% resident, from the GGUF file |" in (tmp_path / "gpu_check.md").read_text()
