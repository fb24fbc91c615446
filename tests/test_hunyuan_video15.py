"""HunyuanVideo 1.5 text to video (HunyuanVideo15Pipeline). The staged video equals plain diffusers' bit for bit
(tests/test_families.py, with and without streaming); here: its embeddings (Qwen2.5-VL and ByT5, each with its
mask) through memfit encode and --embeddings, a prompt's quoted text through the ByT5 encoder, guidance held by the
guider component, the frame and size checks, the default size, the stages' pipelines built without the VAE, and
the decode's activations, which hold the whole video at once; and image to video
(HunyuanVideo15ImageToVideoPipeline), equal to plain diffusers with and without streaming."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfit
from conftest import smallest_budget
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.run.embeddings import Embeddings
from memfit.testing import assert_matches_diffusers, diffusers_output, max_pixel_difference
from memfit.testing.conditioning import test_image as picture

PROMPT = "a red house near the sea"
NEGATIVE = "blurry"
VIDEO = dict(steps=2, guidance=4.0, seed=7, width=32, height=32, frames=5)
NAMES = {f"{prefix}prompt_embeds{part}" for prefix in ("", "negative_") for part in ("", "_mask", "_2", "_mask_2")}


@pytest.fixture
def model(tiny_models):
    return tiny_models("hunyuan_video15")


def test_encode_then_embeddings_equals_plain_diffusers(model, tmp_path):
    """`memfit encode` writes both encoders' embeddings and masks; generating from the file draws plain diffusers'
    video from the prompts; a negative cut to its words' tokens plus some padding (the mask hides the rest) goes
    through as it is and draws the same video."""
    path = tmp_path / "prompt.safetensors"
    assert main(["encode", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--out", str(path),
                 "--quiet"]) == 0
    tensors = Embeddings.load(path).tensors
    assert set(tensors) == NAMES
    assert tensors["prompt_embeds"].shape[1] == 1000 and tensors["prompt_embeds_2"].shape[1] == 256
    assert 0 < int(tensors["prompt_embeds_mask"].sum()) < 16  # the prompt's words, past the template the pipeline crops
    assert not tensors["prompt_embeds_2"].any()  # no quoted text: the glyph embeddings are zero
    ours = memfit.generate(model=model, embeddings=path, progress=False, **VIDEO)
    assert ours.settings.prompt == PROMPT and ours.settings.negative_prompt == NEGATIVE
    assert len(ours.frames) == 5 and max_pixel_difference(ours.frames, diffusers_output(model, ours.settings)) == 0

    cut = dict(tensors)
    for name, kept in (("prompt_embeds", 48), ("prompt_embeds_mask", 48), ("prompt_embeds_2", 16),
                       ("prompt_embeds_mask_2", 16)):
        cut[f"negative_{name}"] = tensors[f"negative_{name}"][:, :kept]
    shorter = Embeddings(cut, "HunyuanVideo15Pipeline", ModelFolder.open(model).text_fingerprint, PROMPT, NEGATIVE)
    cut_run = memfit.generate(model=model, embeddings=shorter, progress=False, **VIDEO)
    assert any("1000 (positive) and 48 (negative)" in note for note in cut_run.report.notes)
    assert max_pixel_difference(cut_run.frames, ours.frames) == 0


def test_quoted_text_runs_the_glyph_encoder(model):
    quoted = 'a sign that says "open"'
    embeddings, _ = memfit.encode(quoted, model=model)
    assert embeddings.tensors["prompt_embeds_2"].any() and embeddings.tensors["prompt_embeds_mask_2"].sum() > 0
    settings = dict(VIDEO, negative_prompt=NEGATIVE, num_frames=VIDEO["frames"])
    del settings["frames"]
    ours, _ = assert_matches_diffusers(model, atol=0, prompt=quoted, **settings)
    plain, _ = assert_matches_diffusers(model, atol=0, prompt="a sign that says open", **settings)
    assert max_pixel_difference(ours.frames, plain.frames) > 0


def test_guidance_is_its_guiders_scale(model):
    """Without --guidance a run takes the guider's own scale (6 in the tiny folder); --guidance rebuilds the guider
    at that scale for the run only; at 1 no negative pass runs, so none is encoded."""
    import diffusers

    adapter = ModelFolder.open(model).adapter
    settings = adapter.resolve(PROMPT, None, 2, None, 7, 32, 32, num_frames=5)
    assert settings.guidance == 6.0 and adapter.guided(settings)
    unguided = adapter.resolve(PROMPT, None, 2, 1.0, 7, 32, 32, num_frames=5)
    assert not adapter.guided(unguided)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    assert adapter.call_components(pipe, settings) == {}
    rebuilt = adapter.call_components(pipe, dataclasses.replace(settings, guidance=4.0))
    assert {name: guider.guidance_scale for name, guider in rebuilt.items()} == {"guider": 4.0}
    assert pipe.guider.guidance_scale == 6.0  # the pipeline's own is left as it is
    result = memfit.generate(PROMPT, model=model, progress=False, **dict(VIDEO, guidance=1.0))
    assert not adapter.guided(result.settings) and result.settings.negative_prompt is None


def test_frames_and_sizes_it_cannot_take_are_refused(model):
    with pytest.raises(MemfitError, match=r"num_frames 6 is not a multiple of 4 plus 1, which "
                                          r"HunyuanVideo15Pipeline needs; use 5 or 9\."):
        memfit.generate(PROMPT, model=model, progress=False, **dict(VIDEO, frames=6))
    with pytest.raises(MemfitError, match=r"The width 30 is not a positive multiple of 4, which "
                                          r"HunyuanVideo15Pipeline needs; use 28 or 32\."):
        memfit.generate(PROMPT, model=model, progress=False, **dict(VIDEO, width=30))


def test_default_size_is_the_pipelines(model):
    """Without --width/--height, the pipeline's own 16:9 bucket at the transformer's target_size: 848x480 for the
    480p models (a 16x VAE, target_size 640), 1280x720 for the 720p ones; 121 frames, 31 latent frames."""
    adapter = ModelFolder.open(model).adapter
    settings = adapter.resolve(PROMPT, None, None, None, 0, None, None)
    assert (settings.width, settings.height, settings.num_frames) == (40, 24, 121)  # the tiny folder's 4x VAE
    adapter.configs["vae"]["spatial_compression_ratio"] = 16
    for target_size, size in ((640, (848, 480)), (960, (1280, 720))):
        adapter.configs["transformer"]["target_size"] = target_size
        settings = adapter.resolve(PROMPT, None, None, None, 0, None, None)
        assert (settings.width, settings.height) == size
    assert adapter.latent_frames(settings) == 31 and adapter.size_multiple() == 16


def test_stages_build_the_pipeline_without_its_vae(model):
    """The pipeline's __init__ reads the VAE's config: the encode and denoise stages build it with a weightless
    stand-in, then without a VAE, as every stage without a component; what it derives is the folder's VAE's."""
    folder = ModelFolder.open(model)
    for stage in ("encode", "denoise"):
        pipe = folder.load_stage(folder.adapter.stage_components(stage), torch.float32)
        assert pipe.vae is None and pipe.config["vae"] == (None, None), stage
        assert (pipe.num_channels_latents, pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (4, 4, 4)


def test_decode_activations_hold_the_whole_video(model):
    """The VAE decodes every frame at once: its activations grow with the frames as the video does (a Wan VAE's,
    decoding a latent frame at a time, grow only by the output frames)."""
    from memfit.plan.activations import stage_strategies

    adapter = ModelFolder.open(model).adapter
    adapter.configs["vae"]["block_out_channels"] = [128, 256, 512, 1024, 1024]  # a real one's
    decode = {frames: stage_strategies(adapter, "decode", adapter.resolve(PROMPT, None, 2, None, 0, 848, 480,
                                                                          num_frames=frames), True, "bf16")[0]
              for frames in (5, 121)}
    assert decode[121].activation_bytes > 848 * 480 * 121 * 128 * 2  # one bf16 tensor of the last up block
    # Each of the 116 more frames adds at least one such tensor (the first upsampler's conv workspace stays the same).
    assert decode[121].activation_bytes - decode[5].activation_bytes > 116 * 848 * 480 * 128 * 2


# ---- image to video (HunyuanVideo15ImageToVideoPipeline) -----------------------------------------------------------

IMAGE = picture(32, seed=1)
I2V = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=2, guidance=4.0, seed=7, num_frames=5, image=IMAGE)


@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
def test_image_to_video_equals_plain_diffusers(tiny_models, guided):
    settings = I2V if guided else dict(I2V, guidance=1.0, negative_prompt=None)
    ours, _ = assert_matches_diffusers(tiny_models("hunyuan_video15_i2v"), atol=0, **settings)
    assert [stage.stage for stage in ours.report.stages] == ["encode", "denoise", "decode"]
    assert ours.settings.task == "img2img" and (ours.settings.width, ours.settings.height) == (32, 32)
    assert len(ours.frames) == 5


def test_image_to_video_streams_and_plans_what_encodes_the_image(tiny_models, streamed_plans, tmp_path, monkeypatch):
    """With the smallest budget that plans, weights stream in the denoise stage and the video is still plain
    diffusers'; the denoise plan places the SigLIP image encoder and the VAE (its encoder) beside the transformer,
    and the image changes the video."""
    model = tiny_models("hunyuan_video15_i2v")
    budget = smallest_budget(model=model, **dict(I2V, steps=1))
    streamed_plans.clear()
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    ours, _ = assert_matches_diffusers(model, atol=0, budget=budget, **I2V)
    stages = {plan.stages[0].name: plan.stages[0] for plan in streamed_plans}
    assert stages["denoise"].streamed_from_disk_bytes > 0
    assert {"transformer", "image_encoder", "vae"} <= {placement.component for placement in stages["denoise"].placements}
    other = memfit.generate(model=model, progress=False, **dict(I2V, image=picture(32, seed=2)))
    assert max_pixel_difference(ours.frames, other.frames) > 0


def test_image_to_video_size_is_the_images_bucket(tiny_models):
    """The pipeline draws at the aspect-ratio bucket of the image at the transformer's target_size: memfit takes that
    size, refuses another --width/--height, and refuses a run without --image."""
    from memfit.models.families.base import Conditioning

    model = tiny_models("hunyuan_video15_i2v")
    adapter = ModelFolder.open(model).adapter
    wide = Conditioning(image=picture(32, seed=1).resize((48, 32)))
    settings = adapter.resolve(PROMPT, None, 2, None, 0, None, None, conditioning=wide, num_frames=5)
    assert (settings.width, settings.height) == (36, 24)  # the 3:2 bucket of 64 4x4 patches
    with pytest.raises(MemfitError, match=r"draws at the size of --image \(36x24\); leave out --width/--height"):
        adapter.resolve(PROMPT, None, 2, None, 0, 48, 32, conditioning=wide, num_frames=5)
    with pytest.raises(MemfitError, match=r"makes a video from an image: pass --image IMG"):
        memfit.generate(model=model, progress=False, **dict(I2V, image=None))
    with pytest.raises(MemfitError, match=r"HunyuanVideo15Pipeline does not take --image"):
        memfit.generate(model=tiny_models("hunyuan_video15"), progress=False, **I2V)
