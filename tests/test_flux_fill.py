"""FLUX.1 Fill (FluxFillPipeline): every run inpaints --image under --mask. Parity with plain diffusers, with and
without a streaming budget, and through an embeddings file, is tests/test_families.py's (row flux_fill); here the
CLI, --strength, a LoRA, and what is refused."""

from __future__ import annotations

import importlib.util

import pytest

import memfit
from memfit.errors import MemfitError
from memfit.testing import diffusers_output, max_pixel_difference
from memfit.testing import conditioning

PROMPT = "a red house near the sea"
IMAGE, MASK = conditioning.test_image(32, seed=1), conditioning.test_mask(32)
RUN = dict(steps=2, guidance=30.0, seed=3, progress=False)


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))


def test_cli_with_image_and_mask_equals_diffusers_and_the_mask_matters(tiny_models, cache_dir, tmp_path):
    from PIL import Image

    from memfit.cli import main

    model = tiny_models("flux_fill")
    image_path, mask_path, out = tmp_path / "in.png", tmp_path / "mask.png", tmp_path / "out.png"
    IMAGE.save(image_path)
    MASK.save(mask_path)
    assert main(["generate", "--model", model, "--prompt", PROMPT, "--steps", "2", "--guidance", "30", "--seed", "3",
                 "--image", str(image_path), "--mask", str(mask_path), "--strength", "0.5", "--out", str(out),
                 "--quiet"]) == 0
    written = Image.open(out)
    assert (written.text["task"], written.text["strength"]) == ("inpaint", "0.5")
    ours = memfit.generate(PROMPT, model=model, image=IMAGE, mask=MASK, strength=0.5, **RUN)
    reference = diffusers_output(model, ours.settings, image=IMAGE, mask_image=MASK)
    assert max_pixel_difference([written.convert("RGB")], reference) == 0
    assert max_pixel_difference(ours.images, reference) == 0
    # The oracle can fail: the pipeline's default strength (1.0), and another mask, each draw something else.
    assert max_pixel_difference(memfit.generate(PROMPT, model=model, image=IMAGE, mask=MASK, **RUN).images, reference) > 0
    other_mask = MASK.copy()
    other_mask.paste(255, (0, 0, 8, 8))  # a corner repainted too
    assert max_pixel_difference(diffusers_output(model, ours.settings, image=IMAGE, mask_image=other_mask), reference) > 0


@pytest.mark.parametrize("missing, expected", [
    (dict(), "FluxFillPipeline fills the masked part of an image: pass --image IMG and --mask MASK"),
    (dict(image=IMAGE), "FluxFillPipeline fills the masked part of an image: pass --image IMG and --mask MASK"),
    (dict(image=IMAGE, mask=MASK, negative_prompt="blurry"), "FluxFillPipeline takes no negative prompt"),
    (dict(image=IMAGE, mask=MASK, true_cfg_scale=4.0), "FluxFillPipeline takes no true_cfg_scale"),
])
def test_what_it_cannot_run_is_refused(tiny_models, cache_dir, missing, expected):
    with pytest.raises(MemfitError, match=expected):
        memfit.generate(PROMPT, model=tiny_models("flux_fill"), **missing, **RUN)


def test_encode_keeps_the_positive_prompt_only(tiny_models, cache_dir):
    embeddings, _ = memfit.encode(PROMPT, model=tiny_models("flux_fill"))
    assert set(embeddings.tensors) == {"prompt_embeds", "pooled_prompt_embeds"}
    with pytest.raises(MemfitError, match="takes no negative prompt"):
        memfit.encode(PROMPT, model=tiny_models("flux_fill"), negative_prompt="blurry")


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRAs need peft (pip install memfit[lora])")
def test_a_lora_equals_diffusers(tiny_models, cache_dir, tmp_path):
    """A PEFT LoRA goes into the transformer through FluxFillPipeline's own loader (Flux's)."""
    from memfit.models.lora import check_loras
    from memfit.testing.conditioning import save_lora

    model = tiny_models("flux_fill")
    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    ours = memfit.generate(PROMPT, model=model, image=IMAGE, mask=MASK, loras=loras, **RUN)
    assert "LoRA(s), unfused" in ours.report.stages[1].note
    reference = diffusers_output(model, ours.settings, loras=check_loras(loras), image=IMAGE, mask_image=MASK)
    assert max_pixel_difference(ours.images, reference) == 0
    assert max_pixel_difference(diffusers_output(model, ours.settings, image=IMAGE, mask_image=MASK), reference) > 0
