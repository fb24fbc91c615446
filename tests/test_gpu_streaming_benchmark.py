"""benchmarks/gpu_streaming.py runs end to end on memfit's fake CUDA runtime, so the command for a GPU
machine is known to work before one is lent (its figures here mean nothing)."""

from __future__ import annotations

import json

import pytest
from conftest import benchmark_script


@pytest.fixture(scope="module")
def benchmark():
    yield from benchmark_script("gpu_streaming", "gpu_streaming")


def test_the_speed_rows_stream_more_as_less_stays_resident(benchmark, tmp_path):
    assert benchmark.main(["--fake", "--steps", "1", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_streaming.json").read_text())
    rows = data["speed"]
    assert [row["resident_fraction"] for row in rows] == list(benchmark.RESIDENT_FRACTIONS)
    streamed = [row["streamed_bytes_per_step"] for row in rows]
    assert streamed[0] == 0 and streamed == sorted(streamed) and streamed[-1] > streamed[1] > 0
    for row in rows:
        assert row["seconds_per_step"] > 0 and row["bound_seconds"] >= data["speed_setup"][
            "compute_seconds_per_step_all_resident"]
    allocated = [row["max_allocated_bytes"] for row in rows]
    # less resident, less on the device (a tiny Flux has few blocks: two fractions may stream the same ones)
    assert allocated[1:] == sorted(allocated[1:], reverse=True) and allocated[-1] < allocated[1] < rows[0]["weights_bytes"]
    assert rows[-1]["pinned_bytes"] >= streamed[-1]  # every streamed weight has a pinned home
    assert "| memfit 25% resident |" in (tmp_path / "gpu_streaming.md").read_text()


@pytest.mark.slow
def test_the_parity_mode_compares_with_plain_diffusers(benchmark, tmp_path):
    assert benchmark.main(["--fake", "--parity", "--families", "sd", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_streaming_parity.json").read_text())["parity"]
    assert [(row["run"], row["max_pixel_difference"], row["error"]) for row in rows] == [
        ("all resident", 0, None), ("denoiser streamed", 0, None)]
