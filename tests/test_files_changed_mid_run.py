"""Issue 35, item 7: a weights file cut short or written to while a run uses it. Before, the process died of
SIGBUS (exit 135) with no message; now the run stops with one sentence naming the file: the files are looked at
between steps (memfit.run.watched_files), and a block memfit streams from a file checks the file still holds it
before its pages are touched."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from memfit.errors import MemfitError
from memfit.run.watched_files import WatchedFiles
from memfit.safetensors_header import MappedFile


def _demo_copy(tmp_path):
    from memfit.demo import model_dir

    return shutil.copytree(model_dir(), tmp_path / "model")


CUT_SHORT_MID_RUN = textwrap.dedent("""
    import os, sys
    import memfit
    from memfit.errors import MemfitError

    model, mode, budget = sys.argv[1], sys.argv[2], sys.argv[3] or None
    unet = os.path.join(model, "unet", "diffusion_pytorch_model.safetensors")

    def on_step(stage, done, total):
        if stage == "denoise" and done == 1:
            if mode == "cut":
                os.truncate(unet, os.path.getsize(unet) // 2)
            else:  # replaced by a finished copy renamed over it: the run keeps the file it mapped
                os.replace(unet + ".new", unet)

    try:
        result = memfit.generate("a red circle", model=model, steps=3, device="cpu", budget=budget, on_step=on_step,
                                 progress=False, threads=1)
    except MemfitError as exc:
        print("REFUSED", exc)
        sys.exit(2)
    print("STREAMED", sum(stage.tiers.get("unet", {}).get("disk", 0) for stage in result.report.stages))
""")


def _run_mid_change(model, mode, budget="+64MiB"):
    return subprocess.run([sys.executable, "-c", CUT_SHORT_MID_RUN, str(model), mode, budget], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("budget", ["", "+64MiB"], ids=["weights-used-in-place", "unet-streamed-from-disk"])
def test_a_weights_file_cut_short_mid_run_stops_it_with_a_sentence_not_a_sigbus(tmp_path, budget):
    model = _demo_copy(tmp_path)
    run = _run_mid_change(model, "cut", budget)
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr[-2000:])  # 135 (SIGBUS) before
    # Whichever sees it first: the look between steps, or a streamed block's check (the reader thread reads ahead).
    said = run.stdout.split("REFUSED ")[-1]
    assert said.startswith(f"{model / 'unet' / 'diffusion_pytorch_model.safetensors'} "), run.stdout
    expected = ["changed while memfit was using it"] + (["was cut short while memfit was reading it"] if budget else [])
    assert any(text in said for text in expected), run.stdout
    assert "Traceback" not in run.stderr, run.stderr[-2000:]


def test_a_file_renamed_over_the_one_a_run_maps_is_not_a_change(tmp_path):
    model = _demo_copy(tmp_path)
    unet = model / "unet" / "diffusion_pytorch_model.safetensors"
    shutil.copyfile(unet, str(unet) + ".new")
    run = _run_mid_change(model, "replace")
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    assert int(run.stdout.split("STREAMED")[1]) > 0, run.stdout  # the run did stream the UNet from disk


def test_watched_files_name_a_change_in_place_and_not_a_replacement(tmp_path):
    first, second, third = (tmp_path / name for name in ("a.bin", "b.bin", "c.bin"))
    for path in (first, second, third):
        path.write_bytes(b"x" * 4096)
    watched = WatchedFiles()
    watched.add([first, second, third])
    watched.check()
    (tmp_path / "new.bin").write_bytes(b"y" * 10)
    os.replace(tmp_path / "new.bin", second)  # another file at the name: the run still maps the old one
    third.unlink()
    watched.check()
    os.truncate(first, 100)
    with pytest.raises(MemfitError, match=r"a.bin changed while memfit was using it \(4096 -> 100 bytes\)"):
        watched.check()


def test_a_block_of_a_file_cut_short_is_an_error_naming_it_before_the_map_is_touched(tmp_path):
    from safetensors.torch import save_file

    from memfit.run.offload import mapped_view

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(4096, dtype=torch.float32)}, str(path))
    pages = mapped_view(MappedFile(path), "a").pages
    pages.check()
    os.truncate(path, pages.end - 100)
    with pytest.raises(MemfitError, match=r"w.safetensors was cut short while memfit was reading it: it has \d+ bytes now"):
        pages.check()
