"""Wan image to video: WanImageToVideoPipeline folders (Wan 2.1 I2V with its CLIP image encoder, Wan 2.2 I2V A14B
with two experts and none) and Wan 2.2 TI2V-5B (a WanPipeline folder with expand_timesteps, whose image path diffusers
runs as WanImageToVideoPipeline). Staged, the video equals plain diffusers' bit for bit (CPU, fp32), with and without
a budget that streams; what encodes the input image is planned in the denoise stage, where the pipeline runs it."""

from __future__ import annotations

import importlib.util
import json
import types

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import memfit
from conftest import smallest_budget
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.models.families.base import Conditioning
from memfit.models.folder import ModelFolder
from memfit.testing import assert_matches_diffusers, max_pixel_difference
from memfit.testing.conditioning import test_image as picture

PROMPT = "a red house near the sea"
IMAGE = picture(32, seed=1)
GUIDED = dict(prompt=PROMPT, negative_prompt="blurry", steps=2, guidance=5.0, seed=7, width=32, height=32,
              frames=5, image=IMAGE)
KINDS = ["wan_i2v", "wan22_i2v", "wan22_ti2v"]
# What the denoise stage loads beside the transformer(s): what encodes the input image.
IMAGE_ENCODERS = {"wan_i2v": {"vae", "image_encoder"}, "wan22_i2v": {"vae"}, "wan22_ti2v": {"vae"}}
# TI2V's tiny VAE shrinks 16x: 64 pixels a side are 2x2 transformer patches a frame.
SIDE = {"wan22_ti2v": 64}


def _settings(kind, **changes):
    side = SIDE.get(kind, 32)
    return dict(GUIDED, width=side, height=side, image=picture(side, seed=1), **changes)


def _matches_diffusers(model, kind, **settings):
    """memfit's video and plain diffusers' for the same image: the folder's own pipeline, except for TI2V,
    whose image path is WanImageToVideoPipeline loaded from the WanPipeline folder (what diffusers offers)."""
    if kind != "wan22_ti2v":
        return assert_matches_diffusers(model, atol=0, **settings)[0]
    ours = memfit.generate(model=model, progress=False, **settings)
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    s = ours.settings
    negative = {} if s.negative_prompt is None else {"negative_prompt": s.negative_prompt}
    call = ModelFolder.open(model).adapter.call_kwargs(s)
    reference = pipe(prompt=s.prompt, image=settings["image"], **negative, **call,
                     generator=torch.Generator().manual_seed(s.seed), output_type="pil").frames[0]
    assert max_pixel_difference(ours.frames, list(reference)) == 0
    return ours


@pytest.fixture(autouse=True)
def prompt_cleaning(monkeypatch):
    """diffusers' I2V module calls ftfy without checking it is installed; where it is not, a stand-in that leaves
    the text as it is (what WanPipeline does without ftfy), for memfit and plain diffusers alike."""
    from diffusers.pipelines.wan import pipeline_wan_i2v

    if getattr(pipeline_wan_i2v, "ftfy", None) is None:
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("kind", KINDS)
def test_equals_diffusers(tiny_models, kind, guided):
    settings = _settings(kind) if guided else _settings(kind, guidance=1.0, negative_prompt=None)
    if guided and kind == "wan22_i2v":  # the second expert's own guidance reaches it as diffusers takes it
        settings["guidance_scale_2"] = 2.0
    ours = _matches_diffusers(tiny_models(kind), kind, **settings)
    assert [stage.stage for stage in ours.report.stages] == ["encode", "denoise", "decode"]
    assert ours.settings.task == "img2img" and len(ours.frames) == 5
    assert ours.metadata["pipeline"] == ("WanPipeline" if kind == "wan22_ti2v" else "WanImageToVideoPipeline")


@pytest.mark.parametrize("kind", KINDS)
def test_the_image_and_the_seed_change_the_video(tiny_models, kind):
    model = tiny_models(kind)
    settings = _settings(kind)
    ours = memfit.generate(model=model, progress=False, **settings)
    another = picture(settings["width"], seed=2)
    other_image = memfit.generate(model=model, progress=False, **dict(settings, image=another))
    assert max_pixel_difference(ours.frames, other_image.frames) > 0
    other_seed = memfit.generate(model=model, progress=False, **dict(settings, seed=8))
    assert max_pixel_difference(ours.frames, other_seed.frames) > 0
    if kind == "wan22_ti2v":  # the same folder without the image makes a video from the prompt alone
        prompt_only = memfit.generate(model=model, progress=False, **dict(settings, image=None))
        assert prompt_only.settings.task == "text2img" and max_pixel_difference(ours.frames, prompt_only.frames) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_budget_keeps_the_video(tiny_models, kind, streamed_plans, tmp_path, monkeypatch):
    """With the smallest budget that plans, weights stream in the denoise stage and the video is still plain
    diffusers'; the denoise plan (each expert's, for Wan 2.2) places what encodes the input image."""
    model = tiny_models(kind)
    settings = _settings(kind)
    budget = smallest_budget(model=model, **dict(settings, steps=1))
    denoise = ModelFolder.open(model).adapter.stage_components("denoise")
    weights = sum(path.stat().st_size for name in denoise for path in (ModelFolder.open(model).path / name).glob(
        "*.safetensors"))
    assert budget < weights
    streamed_plans.clear()
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    _matches_diffusers(model, kind, budget=budget, **settings)
    stages = {plan.stages[0].name: plan.stages for plan in streamed_plans}
    phases = [stage for stage in stages[next(name for name in stages if name.startswith("denoise"))]]
    names = [stage.name for stage in phases]
    assert names == (["denoise:transformer", "denoise:transformer_2"] if kind == "wan22_i2v" else ["denoise"])
    for stage in phases:
        assert IMAGE_ENCODERS[kind] <= {placement.component for placement in stage.placements}, stage.name
    assert sum(stage.streamed_from_disk_bytes for stage in phases) > 0


def test_generates_from_an_embeddings_file(tiny_models, tmp_path):
    """memfit encode needs no image; generating from its file with --image gives the video the prompt gives."""
    model = tiny_models("wan_i2v")
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt="blurry")
    embeddings.save(tmp_path / "prompt.safetensors")
    settings = dict(GUIDED, prompt=None, negative_prompt=None)
    from_file = memfit.generate(model=model, embeddings=tmp_path / "prompt.safetensors", progress=False, **settings)
    assert max_pixel_difference(from_file.frames, memfit.generate(model=model, progress=False, **GUIDED).frames) == 0


def test_refusals(tiny_models, monkeypatch):
    """No image for an image-to-video model, an image for a text-to-video one, --strength (the image is the first
    frame, not noised), --guidance-2 without a second expert, and a missing ftfy: each one sentence."""
    from diffusers.pipelines.wan import pipeline_wan_i2v

    settings = dict(GUIDED, image=None)
    with pytest.raises(MemfitError, match=r"makes a video from an image: pass --image IMG"):
        memfit.generate(model=tiny_models("wan_i2v"), progress=False, **settings)
    with pytest.raises(MemfitError, match=r"This WanPipeline folder makes video from text only and takes no --image"):
        memfit.generate(model=tiny_models("wan"), progress=False, **GUIDED)
    with pytest.raises(MemfitError, match="takes no --strength"):
        memfit.generate(model=tiny_models("wan_i2v"), strength=0.5, progress=False, **GUIDED)
    with pytest.raises(MemfitError, match="transformer_2"):
        memfit.generate(model=tiny_models("wan_i2v"), guidance_scale_2=2.0, progress=False, **GUIDED)
    monkeypatch.setattr(pipeline_wan_i2v, "ftfy", None, raising=False)
    with pytest.raises(MemfitError, match=r"ftfy package, which is not installed; install it \(pip install ftfy\)"):
        memfit.generate(model=tiny_models("wan_i2v"), progress=False, **GUIDED)


def test_size_follows_the_image(tiny_models):
    """Without --width/--height the video has the image's aspect ratio at the pipeline's default area, each side a
    multiple of the transformer's patch in pixels; a side that is given is kept."""
    adapter = ModelFolder.open(tiny_models("wan_i2v")).adapter
    adapter.configs["transformer"]["rope_max_seq_len"] = 1024  # a real Wan's table: the default area fits
    wide = Conditioning(image=Image.new("RGB", (200, 100)))
    settings = adapter.resolve(PROMPT, None, 2, None, 0, None, None, conditioning=wide, num_frames=5)
    width, height = settings.width, settings.height
    assert width % 16 == 0 and height % 16 == 0 and abs(width / height - 2) < 0.1
    assert 0.9 * 832 * 480 < width * height <= 832 * 480
    assert adapter.resolve(PROMPT, None, 2, None, 0, 64, None, conditioning=wide, num_frames=5).width == 64
    # Wan 2.2 TI2V-5B's VAE shrinks 16x: its pipeline would round a side to 32 pixels (two patches) unasked.
    ti2v = ModelFolder.open(tiny_models("wan22_ti2v")).adapter
    with pytest.raises(MemfitError, match="width 48 is not a positive multiple of 32.*use 32 or 64"):
        ti2v.resolve(PROMPT, None, 2, None, 0, 48, 64, conditioning=wide, num_frames=5)


def test_cli_writes_the_video_and_plans_the_image_encoder(tiny_models, tmp_path, capsys):
    """memfit generate --image makes the API's video; memfit plan --model places the image encoder and the VAE's
    encoder in the denoise stage and the VAE's decoder in decode."""
    model = tiny_models("wan_i2v")
    image = tmp_path / "in.png"
    IMAGE.save(image)
    out = tmp_path / "clip.webp"
    assert main(["generate", "--model", model, "--image", str(image), "--prompt", PROMPT, "--negative-prompt", "blurry",
                 "--steps", "2", "--guidance", "5", "--seed", "7", "--width", "32", "--height", "32", "--frames", "5",
                 "--quiet", "--out", str(out)]) == 0
    ours = memfit.generate(model=model, progress=False, **GUIDED)
    with Image.open(out) as video:
        written = []
        for index in range(video.n_frames):
            video.seek(index)
            written.append(np.asarray(video.convert("RGB")))
    assert len(written) == 5 and all(np.array_equal(np.asarray(a), b) for a, b in zip(ours.frames, written))

    capsys.readouterr()
    assert main(["plan", "--model", model, "--budget", "8GiB", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["plan"]["stages"]
    placed = {stage["name"]: {p["component"] for p in stage["placements"]} for stage in stages}
    assert placed == {"encode": {"text_encoder"}, "denoise": {"transformer", "image_encoder", "vae"},
                      "decode": {"vae"}}


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRAs need peft (pip install memfit[lora])")
def test_a_lora_equals_diffusers(tiny_models, tmp_path):
    """--lora reaches the image-to-video transformer through the pipeline's own load_lora_weights, as in diffusers."""
    from memfit.testing import diffusers_output
    from memfit.testing.conditioning import save_lora

    model = tiny_models("wan_i2v")
    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    ours = memfit.generate(model=model, loras=loras, progress=False, **GUIDED)
    reference = diffusers_output(model, ours.settings, loras=loras, image=IMAGE)
    assert max_pixel_difference(ours.frames, reference) == 0
    assert max_pixel_difference(diffusers_output(model, ours.settings, image=IMAGE), reference) > 0


def test_optimize_groups_the_image_encoder_with_the_transformer(tiny_models):
    """memfit.optimize on a live WanImageToVideoPipeline: the CLIP image encoder is planned with the transformer,
    the VAE with decode (where its decoder runs), and the video is unchanged."""
    from memfit.models.families import run_together

    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(tiny_models("wan_i2v"))
    pipe.set_progress_bar_config(disable=True)
    modules = [name for name, value in pipe.components.items() if isinstance(value, torch.nn.Module)]
    assert run_together("WanImageToVideoPipeline", modules) == [
        ("encode", ["text_encoder"]), ("denoise", ["image_encoder", "transformer"]), ("decode", ["vae"])]
    call = dict(prompt=PROMPT, negative_prompt="blurry", image=IMAGE, height=32, width=32, num_frames=5,
                num_inference_steps=2, guidance_scale=5.0, output_type="pil")
    reference = pipe(**call, generator=torch.Generator().manual_seed(7)).frames[0]
    memfit.optimize(pipe)
    try:
        ours = pipe(**call, generator=torch.Generator().manual_seed(7)).frames[0]
    finally:
        memfit.restore(pipe)
    assert max_pixel_difference(list(ours), list(reference)) == 0
