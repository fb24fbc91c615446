"""Under a real memory cap (cgroup v1), plain diffusers is killed and memfit completes.

The case from the field that matters most on CPU: a bf16 run from fp32 files. Plain diffusers
converts every component into anonymous memory at load time and holds them all; memfit's stages
hold one component at a time. (An fp32 run from fp32 files is a weaker test: diffusers leaves
those weights memory-mapped, so under pressure the kernel re-reads them instead of killing.)
The cap is the baseline of a process that only imports torch, diffusers and memfit (measured
here, so the test does not depend on this machine), plus halfway between what memfit must hold
(the largest component in bf16) and what plain diffusers holds (all of them). Page cache is
evicted before each run and counts against the cap; being reclaimable, it cannot kill a run.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from memfit.sizes import format_bytes

from memfit.testing.cgroup import cgroup_unavailable_reason, evict_page_cache, run_capped

reason = cgroup_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(reason is not None, reason=f"cannot cap memory here: {reason}")]

MiB = 2**20

PLAIN = """
import sys, torch, diffusers
pipe = diffusers.DiffusionPipeline.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
pipe.set_progress_bar_config(disable=True)
pipe("a red circle", num_inference_steps=1, guidance_scale=2.0, width=32, height=32)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from memfit.testing import save_pipeline

    folder = tmp_path_factory.mktemp("capped")
    yield str(save_pipeline("sd", folder / "sd", scale=24, text_layers=24))
    shutil.rmtree(folder)


def _run(command, model, cap):
    evict_page_cache(model)
    return run_capped(command, cap, timeout=600)


def test_memfit_completes_where_plain_diffusers_is_killed(model, tmp_path):
    """With no --budget flag: the automatic budget reads the cap from the run's own cgroup, and the
    image is the one an uncapped run draws."""
    plain = [sys.executable, "-c", PLAIN, model]

    def ours(name):
        return [sys.executable, "-m", "memfit", "generate", "--model", model, "--prompt", "a red circle", "--steps", "1",
                "--guidance", "2", "--width", "32", "--height", "32", "--dtype", "bf16", "--quiet",
                "--out", str(tmp_path / f"{name}.png"), "--report", str(tmp_path / f"{name}.json")]
    baseline = _run([sys.executable, "-c", "import torch, diffusers, transformers, memfit.cli.app"], model, None)
    bf16 = {part.name: sum(f.stat().st_size for f in part.glob("*.safetensors")) // 2 for part in Path(model).iterdir()}
    total, largest = sum(bf16.values()), max(bf16.values())
    assert total - largest > 300 * MiB, bf16
    cap = baseline.max_usage_bytes + (largest + total) // 2

    plain_capped, ours_capped = _run(plain, model, cap), _run(ours("capped"), model, cap)
    assert plain_capped.killed, f"plain diffusers fit in {cap / MiB:.0f} MiB"
    assert ours_capped.completed, f"memfit did not fit in {cap / MiB:.0f} MiB: {ours_capped.stderr[-500:]}"
    budget = json.loads((tmp_path / "capped.json").read_text())["budget"]
    assert budget["mode"] == "auto" and f"cgroup limit {format_bytes(cap // 4096 * 4096)}" in budget["source"], budget
    assert _run(ours("uncapped"), model, None).completed
    capped, uncapped = Image.open(tmp_path / "capped.png"), Image.open(tmp_path / "uncapped.png")
    assert np.array_equal(np.asarray(capped), np.asarray(uncapped))



@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A UNet of 755 MiB in bf16 (fp32 files): far more than the process's own memory."""
    from memfit.testing import save_pipeline

    folder = tmp_path_factory.mktemp("wide")
    yield str(save_pipeline("sd", folder / "wide", scale=40))
    shutil.rmtree(folder)


def test_a_component_larger_than_the_cap_in_the_run_dtype_streams(wide_model, tmp_path):
    """A cap below the UNet alone in bf16 (converted from its fp32 files) plus an idle process: loading it
    converted whole, as plain diffusers does, is killed; memfit loads it as views of its files, converts
    the blocks it keeps and streams the rest, with no flag, and draws the uncapped image."""
    model = wide_model

    def ours(name):
        return [sys.executable, "-m", "memfit", "generate", "--model", model, "--prompt", "a red circle", "--steps", "1",
                "--guidance", "2", "--width", "32", "--height", "32", "--dtype", "bf16", "--quiet",
                "--out", str(tmp_path / f"{name}.png"), "--report", str(tmp_path / f"{name}.json")]
    baseline = _run([sys.executable, "-c", "import torch, diffusers, transformers, memfit.cli.app"], model, None)
    unet_bf16 = sum(f.stat().st_size for f in (Path(model) / "unet").glob("*.safetensors")) // 2
    cap = baseline.max_usage_bytes + unet_bf16 * 9 // 10

    assert _run([sys.executable, "-c", PLAIN, model], model, cap).killed
    capped = _run(ours("capped"), model, cap)
    assert capped.completed, f"memfit did not fit in {cap / MiB:.0f} MiB: {capped.stderr[-500:]}"
    notes = json.loads((tmp_path / "capped.json").read_text())["notes"]
    assert any(note.startswith("plan denoise") and "0 B streamed from disk" not in note for note in notes), notes
    assert _run(ours("uncapped"), model, None).completed
    capped_image, uncapped = Image.open(tmp_path / "capped.png"), Image.open(tmp_path / "uncapped.png")
    assert np.array_equal(np.asarray(capped_image), np.asarray(uncapped))
