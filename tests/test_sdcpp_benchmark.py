"""benchmarks/sdcpp.py reads stable-diffusion.cpp's timings off its log and renders its page: checked with a stand-in
for sd-cli that prints the log lines the real one prints (the real binary is not built here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import benchmark_script


# Lines as stable-diffusion.cpp's src/model.cpp and src/stable-diffusion.cpp write them.
SDCPP_LOG = """\
[INFO ] model.cpp:993  - loading tensors completed, taking 3.25s (process: 0.00s, read: 2.10s, memcpy: 0.00s, convert: 0.90s, copy_to_backend: 0.00s)
[INFO ] stable-diffusion.cpp:858  - total params memory size = 2211.47MB (VRAM 0.00MB, RAM 2211.47MB): text_encoders 235.06MB(RAM), diffusion_model 1816.34MB(RAM), vae 160.07MB(RAM), controlnet 0.00MB(VRAM), pmid 0.00MB(RAM)
[INFO ] stable-diffusion.cpp:3168 - get_learned_condition completed, taking 0.41s
[INFO ] stable-diffusion.cpp:3432 - sampling completed, taking 21.50s
[INFO ] stable-diffusion.cpp:3212 - decode_first_stage completed, taking 9.75s
[INFO ] stable-diffusion.cpp:3591 - generate_image completed in 31.90s
"""


@pytest.fixture(scope="module")
def benchmark():
    yield from benchmark_script("sdcpp", "sdcpp_benchmark")


def _fake_sd(tmp_path: Path, log: str, code: int = 0) -> Path:
    (tmp_path / "log.txt").write_text(log)
    script = tmp_path / "sd-cli"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'log.txt'} >&2\nexit {code}\n")
    script.chmod(0o755)
    return script


def test_the_sdcpp_child_reads_the_timings_and_weights_off_the_log(benchmark, tmp_path):
    row = benchmark.run_sdcpp_child([str(_fake_sd(tmp_path, SDCPP_LOG))])
    assert (row["load_s"], row["encode_s"], row["denoise_s"], row["decode_s"], row["generate_s"]) == (
        3.25, 0.41, 21.5, 9.75, 31.9)
    assert row["params_mb"] == {"total": 2211.47, "text_encoder": 235.06, "unet": 1816.34, "vae": 160.07}
    assert row["peak_rss"] > 0 and row["wall_s"] > 0


def test_a_failing_sdcpp_run_fails_the_child(benchmark, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        benchmark.run_sdcpp_child([str(_fake_sd(tmp_path, "[ERROR] load from file failed\n", code=3))])
    assert stopped.value.code == 3


def test_the_page_has_a_row_per_configuration_and_the_commands(benchmark, tmp_path):
    class Args:
        sd, file, config, size, steps, threads = "sd-cli", "m.safetensors", "cfg", 256, 4, 2

    configs = benchmark.configurations(["q8_0"], "4.5GiB")
    assert [benchmark.label(c) for c in configs] == [
        "sd.cpp", "memfit", "sd.cpp --type q8_0", "memfit --quantize unet=q8_0", "memfit --quantize unet=q8_0 --budget 4.5GiB"]
    rows = []
    for round_ in range(2):
        for index, config in enumerate(configs):
            rows.append({**config, "round": round_, "steps": 4, "completed": True, "killed": False,
                         "wall_s": 10.0 + index + round_, "cpu_s": 20.0, "denoise_s": 8.0, "peak_rss": (index + 1) * 2**30,
                         "cgroup_peak": None, "params_mb": None, "notes": []})
    summary = benchmark.summarize(rows, configs)
    assert [e["wall_s"] for e in summary] == [10.5, 11.5, 12.5, 13.5, 14.5] and summary[0]["step_s"] == 2.0
    commands = {benchmark.label(c): (benchmark.sdcpp_command(Args, c["precision"], "out.png") if c["system"] == "sd.cpp"
                                     else benchmark.memfit_cli(Args, c["precision"], c["budget"])) for c in configs}
    assert commands["sd.cpp --type q8_0"][-2:] == ["--type", "q8_0"] and "-t" in commands["sd.cpp"]
    assert commands["memfit --quantize unet=q8_0 --budget 4.5GiB"][-4:] == ["--quantize", "unet=q8_0", "--budget", "4.5GiB"]
    data = {"command": "...", "settings": {"size": 256, "steps": 4, "threads": 2, "cap": None, "file": "m.safetensors",
                                           "file_dtype": "fp32", "rounds": 2},
            "file_bytes": 4 * 2**30, "sdcpp_version": "test", "machine": {"cpu": "cpu", "cpu_count": 2},
            "rows": rows, "summary": summary, "commands": commands}
    page = benchmark.render(data)
    assert "| memfit --quantize unet=q8_0 | 2/2 | 13.50 |" in page
    assert "| sd.cpp | 2/2 | 10.50 | 20.00 | - | 8.00 | 2.00 | - | 1.00 GiB | - |" in page
    assert "`sd-cli -m m.safetensors" in page
