"""LTX-Video (LTXPipeline). The staged video equals plain diffusers' bit for bit (tests/test_families.py, with and
without streaming); here: its T5 embeddings and masks through memfit encode and --embeddings (a shorter negative
padded with masked zeros), the frame and size checks (LTX-2's too), the default size, the plan, a LoRA; and image
to video, the same folder run as LTXImageToVideoPipeline for --image (and a folder saved as that class), equal to
plain diffusers with and without streaming."""

from __future__ import annotations

import importlib.util
import json

import diffusers
import pytest
import torch

import memfit
from conftest import smallest_budget
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.models.families.base import Conditioning
from memfit.models.folder import ModelFolder
from memfit.run.embeddings import Embeddings
from memfit.testing import assert_matches_diffusers, diffusers_output, max_pixel_difference
from memfit.testing.conditioning import test_image as picture

PROMPT = "a red house near the sea"
NEGATIVE = "blurry"
VIDEO = dict(steps=2, guidance=3.0, seed=7, width=32, height=32, frames=5)
NAMES = {f"{prefix}prompt_{part}" for prefix in ("", "negative_") for part in ("embeds", "attention_mask")}


@pytest.fixture
def model(tiny_models):
    return tiny_models("ltx")


def test_encode_then_embeddings_equals_plain_diffusers(model, tmp_path):
    """`memfit encode` writes the embeddings and masks, padded to the pipeline's 128 tokens; generating from the file
    draws plain diffusers' video from the prompts; a negative cut to its words' tokens goes through padded with
    masked zeros and draws the same video."""
    path = tmp_path / "prompt.safetensors"
    assert main(["encode", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--out", str(path),
                 "--quiet"]) == 0
    tensors = Embeddings.load(path).tensors
    assert set(tensors) == NAMES
    assert tensors["prompt_embeds"].shape[1] == 128 and tensors["negative_prompt_embeds"].shape[1] == 128
    words = int(tensors["negative_prompt_attention_mask"].sum())
    assert 0 < words < 8
    ours = memfit.generate(model=model, embeddings=path, progress=False, **VIDEO)
    assert ours.settings.prompt == PROMPT and ours.settings.negative_prompt == NEGATIVE
    assert len(ours.frames) == 5 and max_pixel_difference(ours.frames, diffusers_output(model, ours.settings)) == 0

    cut = dict(tensors)
    for name in ("prompt_embeds", "prompt_attention_mask"):
        cut[f"negative_{name}"] = tensors[f"negative_{name}"][:, :words]
    shorter = Embeddings(cut, "LTXPipeline", ModelFolder.open(model).text_fingerprint, PROMPT, NEGATIVE)
    cut_run = memfit.generate(model=model, embeddings=shorter, progress=False, **VIDEO)
    assert any(f"128 (positive) and {words} (negative)" in note for note in cut_run.report.notes)
    assert max_pixel_difference(cut_run.frames, ours.frames) == 0


@pytest.mark.parametrize("family, class_name", [("ltx", "LTXPipeline"), ("ltx2", "LTX2Pipeline")])
def test_frames_and_sizes_it_cannot_take_are_refused(tiny_models, family, class_name):
    """LTX-Video and LTX-2 alike (their tiny VAEs compress 4x in time): frames not 4k+1 and sides not a multiple of
    32 are refused before anything runs, naming the nearest ones that are taken."""
    model = tiny_models(family)
    with pytest.raises(MemfitError, match=rf"num_frames 6 is not a multiple of 4 plus 1, which {class_name} needs; "
                                          r"use 5 or 9\."):
        memfit.generate(PROMPT, model=model, progress=False, **dict(VIDEO, frames=6))
    with pytest.raises(MemfitError, match=rf"The width 48 is not a positive multiple of 32, which {class_name} needs; "
                                          r"use 32 or 64\."):
        memfit.generate(PROMPT, model=model, progress=False, **dict(VIDEO, width=48))


def test_default_size_and_the_real_vaes_rules(model):
    """Without --width/--height, __call__'s 704x512 and 161 frames; the real VAE (4x4 patches, three scaling blocks)
    compresses 32x and 8x in time, so frames are 8k+1 (161 frames, 21 latent frames)."""
    adapter = ModelFolder.open(model).adapter
    settings = adapter.resolve(PROMPT, None, None, None, 0, None, None)
    assert (settings.width, settings.height, settings.num_frames, settings.guidance) == (704, 512, 161, 3.0)
    assert (adapter.vae_scale_factor(), adapter.temporal_scale_factor()) == (8, 4)  # the tiny VAE's
    adapter.configs["vae"].update(patch_size=4, spatio_temporal_scaling=[True, True, True, False])
    assert (adapter.vae_scale_factor(), adapter.temporal_scale_factor(), adapter.size_multiple()) == (32, 8, 32)
    assert adapter.latent_frames(adapter.resolve(PROMPT, None, None, None, 0, None, None)) == 21
    with pytest.raises(MemfitError, match=r"num_frames 5 is not a multiple of 8 plus 1.*use 1 or 9\."):
        adapter.resolve(PROMPT, None, 2, None, 0, 32, 32, num_frames=5)


def test_plan_places_each_stage_and_the_decode_grows_with_the_video(model, capsys):
    """memfit plan --model plans the three stages from the configs; the VAE decodes every frame at once, so its
    activations grow with the frames as the video does."""
    from memfit.plan.activations import stage_strategies

    assert main(["plan", "--model", model, "--budget", "8GiB", "--json"]) == 0
    stages = {stage["name"]: stage for stage in json.loads(capsys.readouterr().out)["plan"]["stages"]}
    assert {name: {p["component"] for p in stage["placements"]} for name, stage in stages.items()} == {
        "encode": {"text_encoder"}, "denoise": {"transformer"}, "decode": {"vae"}}
    adapter = ModelFolder.open(model).adapter
    decode = {frames: stage_strategies(adapter, "decode", adapter.resolve(PROMPT, None, 2, None, 0, 704, 512,
                                                                          num_frames=frames), True, "bf16")[0]
              for frames in (5, 161)}
    assert decode[161].activation_bytes / decode[5].activation_bytes > 20


# ---- image to video (LTXImageToVideoPipeline) ----------------------------------------------------------------------

IMAGE = picture(32, seed=1)
I2V = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=2, guidance=3.0, seed=7, num_frames=5, width=32, height=32,
           image=IMAGE)


def _plain_image_to_video(model, settings, image):
    """Plain diffusers' video: the folder loaded as LTXImageToVideoPipeline, as diffusers' own example does."""
    pipe = diffusers.LTXImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    negative = {} if settings.negative_prompt is None else {"negative_prompt": settings.negative_prompt}
    return list(pipe(prompt=settings.prompt, image=image, **negative, **ModelFolder.open(model).adapter.call_kwargs(
        settings), generator=torch.Generator().manual_seed(settings.seed), output_type="pil").frames[0])


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
def test_image_to_video_equals_plain_diffusers(model, guided):
    settings = I2V if guided else dict(I2V, guidance=1.0, negative_prompt=None)
    ours = memfit.generate(model=model, progress=False, **settings)
    assert [stage.stage for stage in ours.report.stages] == ["encode", "denoise", "decode"]
    assert ours.settings.task == "img2img" and len(ours.frames) == 5
    assert max_pixel_difference(ours.frames, _plain_image_to_video(model, ours.settings, IMAGE)) == 0
    other = memfit.generate(model=model, progress=False, **dict(settings, image=picture(32, seed=2)))
    assert max_pixel_difference(ours.frames, other.frames) > 0


def test_image_to_video_streams_and_plans_the_vaes_encoder(model, streamed_plans, tmp_path, monkeypatch):
    budget = smallest_budget(model=model, **dict(I2V, steps=1))
    streamed_plans.clear()
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    ours = memfit.generate(model=model, progress=False, budget=budget, **I2V)
    stages = {plan.stages[0].name: plan.stages[0] for plan in streamed_plans}
    assert stages["denoise"].streamed_from_disk_bytes > 0
    assert {placement.component for placement in stages["denoise"].placements} == {"transformer", "vae"}
    assert max_pixel_difference(ours.frames, _plain_image_to_video(model, ours.settings, IMAGE)) == 0


def test_image_to_video_size_is_the_images_aspect(model):
    """Without --width/--height: the image's aspect ratio at the area of 704x512, each side a multiple of 32."""
    adapter = ModelFolder.open(model).adapter
    wide = Conditioning(image=picture(32, seed=1).resize((96, 48)))
    settings = adapter.resolve(PROMPT, None, 2, None, 0, None, None, conditioning=wide, num_frames=5)
    assert (settings.width, settings.height) == (832, 416)


def test_a_folder_saved_as_the_image_to_video_class(tiny_models):
    model = tiny_models("ltx_i2v")
    ours, _ = assert_matches_diffusers(model, atol=0, **I2V)
    assert ours.settings.task == "img2img" and ours.metadata["pipeline"] == "LTXImageToVideoPipeline"
    with pytest.raises(MemfitError, match=r"makes a video from an image: pass --image IMG"):
        memfit.generate(model=model, progress=False, **dict(I2V, image=None))


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRAs need peft (pip install memfit[lora])")
def test_a_lora_goes_into_the_transformer(model, tmp_path):
    """--lora through the pipeline's own load_lora_weights: plain diffusers' video with it, another without it."""
    from memfit.models.lora import check_loras
    from memfit.testing.conditioning import save_lora

    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    ours = memfit.generate(PROMPT, model=model, progress=False, loras=loras, **dict(VIDEO, negative_prompt=NEGATIVE))
    assert "LoRA(s), unfused" in ours.report.stages[1].note
    reference = diffusers_output(model, ours.settings, loras=check_loras(loras))
    assert max_pixel_difference(ours.frames, reference) == 0
    assert max_pixel_difference(diffusers_output(model, ours.settings), reference) > 0
