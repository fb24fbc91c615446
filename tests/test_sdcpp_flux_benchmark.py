"""benchmarks/sdcpp_flux.py's configurations, commands and page, checked without the real-size files or sd-cli (the
runs themselves take the files it builds: about 12 GB)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import benchmark_script


GiB = 2**30


@pytest.fixture(scope="module")
def benchmark():
    yield from benchmark_script("sdcpp_flux", "sdcpp_flux_benchmark")


def test_memfit_runs_under_every_cap_and_sdcpp_under_the_largest_with_mmap(benchmark):
    class Args:
        sd, size, steps, threads, models = "sd-cli", 256, 4, 2, Path("m")

    assert benchmark.configurations([6.0, 4.0]) == [("memfit", 6.0), ("memfit", 4.0), ("memfit", None),
                                                    ("sd.cpp", None), ("sd.cpp", 6.0)]
    files = {component: Path("m") / name for component, name in benchmark.FILES.items()}
    plain = benchmark.sdcpp_command(Args, files, False, "out.png", "a prompt")
    assert plain[plain.index("--diffusion-model") + 1] == str(files["transformer"])
    assert plain[plain.index("--t5xxl") + 1] == str(files["text_encoder_2"]) and "--mmap" not in plain
    assert benchmark.sdcpp_command(Args, files, True, "out.png", "a prompt")[-1] == "--mmap"
    memfit = benchmark.memfit_cli(Args, files)
    assert memfit[memfit.index("--model") + 1] == str(files["transformer"]) and "--budget" not in memfit
    assert f"text_encoder_2={files['text_encoder_2']}" in memfit


def test_the_page_has_a_row_per_configuration_a_killed_one_included(benchmark):
    rows = [
        {"system": "memfit", "cap_gib": 6.0, "completed": True, "killed": False, "wall_s": 500.0, "cpu_s": 900.0,
         "encode_s": 50.0, "denoise_s": 400.0, "decode_s": 4.0, "peak_rss": 5 * GiB, "cgroup_peak": 6 * GiB,
         "round": 0, "steps": 4, "stages": {"denoise": {"seconds": 400.0, "peak": 5 * GiB,
                                                          "tiers": {"transformer": {"device": 4 * GiB, "disk": 2 * GiB}}}}},
        {"system": "sd.cpp", "cap_gib": 6.0, "completed": False, "killed": True, "cgroup_peak": 6 * GiB, "round": 0,
         "steps": 4},
        {"system": "sd.cpp", "cap_gib": None, "completed": True, "killed": False, "wall_s": 300.0, "cpu_s": 600.0,
         "denoise_s": 200.0, "peak_rss": 15 * GiB, "cgroup_peak": 20 * GiB, "round": 0, "steps": 4,
         "params_mb": {"total": 15800.0, "text_encoder": 9300.0, "unet": 6400.0, "vae": 94.0}},
    ]
    summary = benchmark.summarize(rows)
    assert [e["label"] for e in summary] == ["memfit, 6 GiB cap", "sd.cpp (--mmap), 6 GiB cap", "sd.cpp, no cap"]
    assert summary[0]["step_s"] == 100.0 and summary[1]["outcome"] == "completed 0/1, killed 1"
    data = {"command": "...", "settings": {"size": 256, "steps": 4, "threads": 2},
            "machine": {"cpu": "cpu", "cpu_count": 2}, "sdcpp_version": "test", "first_run_s": 200.0,
            "file_bytes": {"m/flux1-dev-Q4_K.gguf": 6.7e9}, "rows": rows, "summary": summary,
            "remarks": ["A remark."], "commands": {"memfit": ["memfit", "generate"], "sd.cpp": ["sd-cli"]}}
    page = benchmark.render(data)
    assert "| memfit, 6 GiB cap | completed 1/1 | 500.0 | 900.0 | 50.0 | 400.0 | 100.0 | 4.0 | 5.00 GiB | 6.00 GiB |" in page
    assert "| sd.cpp (--mmap), 6 GiB cap | completed 0/1, killed 1 | - |" in page
    assert "transformer: device 4.00 GiB, disk 2.00 GiB" in page and "A remark." in page
    assert "killed (out of memory)" in page and "transformer 6400" in page
