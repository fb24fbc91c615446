"""SDXL base + refiner: diffusers' documented workflow, staged, shared parts once.

Compiled graphs for a base and a refiner sharing one VAE must save and load
correctly; memfit's compile cache is keyed by content, so the shared VAE is one entry whichever
pipeline asks for it, and a fresh process loads everything from the cache (MEMFIT_CACHE=require).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import memfit
from memfit.testing.runtimes import WeightsOnlyCpu
from memfit.compile.backends import get_backend
from memfit.cache import open_store
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.cache.fingerprint import fingerprint_folder
from memfit.plan import meta
from memfit.testing import diffusers_refined_image, max_pixel_difference, save_base_and_refiner

pytestmark = pytest.mark.slow  # runs whole pipelines, often in fresh processes

SETTINGS = dict(prompt="a red house", steps=5, guidance=3.0, seed=3, width=32, height=32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdxl-pair")
    base, refiner = save_base_and_refiner(root / "base", root / "refiner", seed=0)
    return str(base), str(refiner)


def _reference(pair, **overrides):
    settings = {**SETTINGS, **overrides}
    return diffusers_refined_image(*pair, **settings)


def test_builder_saves_shared_components_with_identical_content(pair):
    base, refiner = pair
    for name in ("vae", "text_encoder_2", "tokenizer_2"):
        assert fingerprint_folder(f"{base}/{name}") == fingerprint_folder(f"{refiner}/{name}"), name
    index = json.loads(open(f"{refiner}/model_index.json").read())
    assert index["_class_name"] == "StableDiffusionXLImg2ImgPipeline"
    assert index["text_encoder"] == [None, None] and index["requires_aesthetics_score"] is True


@pytest.mark.parametrize("negative_prompt", [None, "blurry"])
def test_base_plus_refiner_equals_diffusers_documented_workflow_bitwise(pair, negative_prompt):
    base, refiner = pair
    ours = memfit.generate(model=base, refiner=refiner, negative_prompt=negative_prompt, progress=False, **SETTINGS)
    reference = _reference(pair, negative_prompt=negative_prompt)
    assert max_pixel_difference(ours.images[0], reference) == 0
    report = ours.report
    assert [s.stage for s in report.stages] == ["encode", "denoise", "refine", "decode"]
    # The refiner's text_encoder_2 is the base's object: loaded once, not listed twice.
    encode = report.stages[0]
    assert encode.components.count("text_encoder_2") == 1 and "refiner.text_encoder_2" not in encode.components
    assert any("shares text_encoder_2" in note for note in report.notes)
    assert report.settings["refiner_start"] == 0.8 and ours.metadata["refiner"] == refiner


def test_a_budget_fits_every_stage_of_base_and_refiner_like_generate(pair, tmp_path, monkeypatch):
    """Base + refiner runs through the same stage runner as generate: a budget below what the
    process already holds is refused the same way, and a budget that streams fits every stage that
    loads weights (planned peak and strategy in the report) with the image unchanged."""
    base, refiner = pair
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))  # no prompt-cache hit: the encoders load
    with pytest.raises(MemfitError, match="smallest budget that works is above"):
        memfit.generate(model=base, refiner=refiner, budget="300KiB", progress=False, **SETTINGS)
    # The process's own memory and the calibrated kernel workspace (real-size offsets) would swamp
    # these tiny models: count only what memfit places and the activations' proportional part.
    monkeypatch.setattr(meta, "ACTIVATION_OFFSETS", dict.fromkeys(meta.ACTIVATION_OFFSETS, 0))
    ours = memfit.generate(model=base, refiner=refiner, budget="600KiB", progress=False, device=WeightsOnlyCpu(),
                           **SETTINGS)
    assert max_pixel_difference(ours.images[0], _reference(pair)) == 0
    stages = {stage.stage: stage for stage in ours.report.stages}
    assert list(stages) == ["encode", "denoise", "refine", "decode"]
    for stage in stages.values():
        assert stage.planned_peak_bytes is not None and stage.strategy, stage.stage
    streamed = [note for note in ours.report.notes if note.startswith("plan ") and "0 B streamed from disk" not in note]
    assert streamed, "600 KiB must stream some weights of these tiny models"
    # The refiner's text_encoder_2 is the base's (fitted) object: the refiner's encode loads only a tokenizer.
    assert len([note for note in ours.report.notes if note.startswith("plan encode")]) == 1


def test_refiner_start_is_honoured_and_cli_matches_api(pair, tmp_path):
    base, refiner = pair
    out = tmp_path / "refined.png"
    code = main(["generate", "--model", base, "--refiner", refiner, "--refiner-start", "0.6", "--prompt", SETTINGS["prompt"],
                 "--steps", "5", "--guidance", "3.0", "--seed", "3", "--width", "32", "--height", "32", "--quiet",
                 "--out", str(out)])
    assert code == 0
    image = Image.open(out)
    assert image.text["refiner_start"] == "0.6" and image.text["refiner"] == refiner
    reference = _reference(pair, refiner_start=0.6)
    assert max_pixel_difference(image.convert("RGB"), reference) == 0
    assert max_pixel_difference(reference, _reference(pair)) > 0  # 0.6 is not 0.8


def test_bad_refiner_requests_are_one_clear_error(pair, tiny_models):
    base, refiner = pair
    with pytest.raises(MemfitError, match="SDXL refiner"):
        memfit.generate(model=refiner, progress=False, **SETTINGS)  # a refiner alone cannot start from a prompt
    with pytest.raises(MemfitError, match="between 0 and 1"):
        memfit.generate(model=base, refiner=refiner, refiner_start=1.2, progress=False, **SETTINGS)
    with pytest.raises(MemfitError, match="only applies with --refiner"):
        memfit.generate(model=base, refiner_start=0.5, progress=False, **SETTINGS)
    with pytest.raises(MemfitError, match="SDXL base"):
        memfit.generate(model=tiny_models("sd"), refiner=refiner, progress=False, **SETTINGS)
    with pytest.raises(MemfitError, match="is a StableDiffusionXLPipeline"):
        memfit.generate(model=base, refiner=base, progress=False, **SETTINGS)


_FRESH_PROCESS = """
import json, sys
import numpy as np
import memfit

result = memfit.generate(model=sys.argv[1], refiner=sys.argv[2], backend=json.loads(sys.argv[3]), progress=False,
                         **json.loads(sys.argv[4]))
np.save(sys.argv[5], np.asarray(result.images[0]))
print(json.dumps([[r["component"], r["entry"], r["status"]] for s in result.report.stages for r in s.compiled]))
"""


def _compiled_entries():
    return [entry for entry in open_store().ls() if entry.kind == "compiled"]


def test_compiled_once_then_loaded_from_cache_in_a_fresh_process(pair, tmp_path, monkeypatch):
    """Failure 4: base and refiner share the VAE and text_encoder_2; each is compiled once, stored
    once, and a fresh process under MEMFIT_CACHE=require loads both pipelines from the cache."""
    ok, why = get_backend("onnxruntime").available()
    if not ok:
        pytest.skip(why)
    base, refiner = pair
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    backend = {"vae": "onnxruntime", "text_encoder_2": "onnxruntime"}
    eager = memfit.generate(model=base, refiner=refiner, progress=False, **SETTINGS).images[0]

    first = memfit.generate(model=base, refiner=refiner, backend=backend, progress=False, **SETTINGS)
    statuses = [(r["component"], r["entry"], r["status"]) for s in first.report.stages for r in s.compiled]
    # text_encoder_2 serves both encodes: compiled for the base, the same entry reused by the refiner.
    assert ("text_encoder_2", "forward", "compiled") in statuses and ("text_encoder_2", "forward", "shared") in statuses
    assert ("vae", "decode", "compiled") in statuses
    assert len(_compiled_entries()) == 2  # one text_encoder_2 forward, one VAE decode
    tolerance = 1  # onnxruntime's float32 tolerance (1e-4) is at most one 8-bit level after rounding
    assert max_pixel_difference(first.images[0], eager) <= tolerance

    # The base pipeline's own VAE folder (a different path, the same content) finds the refiner's
    # entry: no second export, no second entry.
    alone = memfit.generate(model=base, backend={"vae": "onnxruntime"}, progress=False, **SETTINGS)
    vae_records = [r for s in alone.report.stages for r in s.compiled if r["component"] == "vae" and r["entry"] == "decode"]
    assert [r["status"] for r in vae_records] == ["compiled"]
    assert len(_compiled_entries()) == 2

    # A fresh process: every compiled artifact and prompt embedding must come from the cache.
    settings = {k: v for k, v in SETTINGS.items()}
    env = {**os.environ, "MEMFIT_CACHE": "require", "MEMFIT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "fresh.npy"
    run = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, base, refiner, json.dumps(backend), json.dumps(settings), str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    fresh_statuses = json.loads(run.stdout.strip().splitlines()[-1])
    assert ["vae", "decode", "compiled"] in fresh_statuses
    fresh = np.load(out)
    assert max_pixel_difference(fresh, eager) <= tolerance
    assert max_pixel_difference(fresh, first.images[0]) == 0  # a cached run gives what the first gave
    assert len(_compiled_entries()) == 2
