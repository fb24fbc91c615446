"""LTX-2 (LTX2Pipeline), video with audio. The staged video and its soundtrack equal plain diffusers' bit for bit
(tests/test_families.py, with and without streaming; the parity oracle compares the waveform too); here: its Gemma-3
embeddings through memfit encode and --embeddings (a shorter negative padded on the left with masked zeros), the
soundtrack in the files memfit generate --out writes (AAC in an .mp4, a WAV beside a .gif), the frame, size and
guidance rules, the plan of its six weighted components, a LoRA; and image to video, the same folder run as
LTX2ImageToVideoPipeline for --image (and a folder saved as that class), equal to plain diffusers with and without
streaming."""

from __future__ import annotations

import importlib.util
import json
import wave

import diffusers
import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

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
VIDEO = dict(steps=2, guidance=3.0, seed=7, width=32, height=32, frames=9)
NAMES = {f"{prefix}prompt_{part}" for prefix in ("", "negative_") for part in ("embeds", "attention_mask")}


@pytest.fixture
def model(tiny_models):
    return tiny_models("ltx2")


@pytest.fixture(scope="module")
def clip(tiny_models):
    """One LTX-2 video through the API, and the CLI's arguments for the same video."""
    model = tiny_models("ltx2")
    result = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, progress=False, **VIDEO)
    args = ["generate", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", "2",
            "--guidance", "3", "--seed", "7", "--width", "32", "--height", "32", "--frames", "9", "--quiet"]
    return result, args


def _same_soundtrack(ours, reference) -> bool:
    return ours.audio_sample_rate == reference.sample_rate and bool((ours.audio == reference.audio).all())


def test_encode_then_embeddings_equals_plain_diffusers(model, tmp_path):
    """`memfit encode` writes Gemma-3's stacked hidden states and masks, left-padded to the pipeline's 1024 tokens;
    generating from the file (no encode stage) makes plain diffusers' video and soundtrack; a negative cut to its
    words' tokens goes through padded on the left with masked zeros and makes the same ones (the connectors put
    their learned registers where the mask is 0, whatever the padding held)."""
    path = tmp_path / "prompt.safetensors"
    assert main(["encode", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--out", str(path),
                 "--quiet"]) == 0
    tensors = Embeddings.load(path).tensors
    assert set(tensors) == NAMES
    config = ModelFolder.open(model).configs["text_encoder"]["text_config"]
    assert tensors["prompt_embeds"].shape == (1, 1024, config["hidden_size"] * (config["num_hidden_layers"] + 1))
    words = int(tensors["negative_prompt_attention_mask"].sum())
    assert 0 < words < 8 and tensors["negative_prompt_attention_mask"][0, -words:].all()  # Gemma pads on the left
    ours = memfit.generate(model=model, embeddings=path, progress=False, **VIDEO)
    assert [stage.stage for stage in ours.report.stages] == ["denoise", "decode"]
    assert ours.settings.prompt == PROMPT and ours.settings.negative_prompt == NEGATIVE
    reference = diffusers_output(model, ours.settings)
    assert len(ours.frames) == 9 and max_pixel_difference(ours.frames, reference) == 0
    assert _same_soundtrack(ours, reference)

    cut = dict(tensors)
    for name in ("prompt_embeds", "prompt_attention_mask"):
        cut[f"negative_{name}"] = tensors[f"negative_{name}"][:, -words:]
    shorter = Embeddings(cut, "LTX2Pipeline", ModelFolder.open(model).text_fingerprint, PROMPT, NEGATIVE)
    cut_run = memfit.generate(model=model, embeddings=shorter, progress=False, **VIDEO)
    assert any(f"1024 (positive) and {words} (negative)" in note for note in cut_run.report.notes)
    assert max_pixel_difference(cut_run.frames, ours.frames) == 0 and bool((cut_run.audio == ours.audio).all())


def test_the_prompt_cache_keeps_gemmas_embeddings(clip, model):
    """A second run with the same prompts loads no text encoder: the stacked hidden states come from the prompt
    cache (keyed by the text encoder's content), and the video and soundtrack are the first run's."""
    first, _ = clip
    again = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, progress=False, **VIDEO)
    encode = again.report.stages[0]
    if encode.note != "cache hit":  # the module's first run may have cached in another test's store
        again = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, progress=False, **VIDEO)
        encode = again.report.stages[0]
    assert (encode.stage, encode.components, encode.note) == ("encode", [], "cache hit")
    assert max_pixel_difference(again.frames, first.frames) == 0 and bool((again.audio == first.audio).all())


def test_the_soundtrack_is_the_videos_length(clip):
    result, _ = clip
    assert result.frames_per_second == 24 and result.audio_sample_rate == 8000  # the tiny vocoder's rate
    channels, samples = result.audio.shape
    assert channels == 2 and abs(samples / 8000 - 9 / 24) < 0.05  # 9 frames at 24 a second
    assert 0 < float(result.audio.abs().max()) <= 1


def test_mp4_carries_the_soundtrack(clip, tmp_path):
    av = pytest.importorskip("av")
    result, args = clip
    out = tmp_path / "clip.mp4"
    assert main([*args, "--out", str(out)]) == 0
    with av.open(str(out)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert json.loads(container.metadata["comment"])["num_frames"] == "9"
        assert (audio.codec_context.name, audio.rate, audio.channels) == ("aac", 8000, 2)
        assert abs(float(audio.duration * audio.time_base) - result.audio.shape[1] / 8000) < 1e-3
        assert len(list(container.decode(video))) == 9
        container.seek(0)
        heard = np.concatenate([frame.to_ndarray() for frame in container.decode(audio)], axis=1)
    # AAC is lossy and starts with its encoder's priming samples: the same tone, not the same samples.
    assert heard.shape[0] == 2 and heard.shape[1] >= result.audio.shape[1]
    assert abs(float(np.sqrt((heard ** 2).mean())) - float(result.audio.pow(2).mean().sqrt())) < 0.05


def test_gif_writes_the_soundtrack_beside_it(clip, tmp_path, capsys):
    result, args = clip
    out = tmp_path / "clip.gif"
    assert main([*args, "--out", str(out)]) == 0
    assert f"wrote {tmp_path / 'clip.wav'} (the soundtrack)" in capsys.readouterr().out
    with wave.open(str(tmp_path / "clip.wav")) as sound:
        assert (sound.getnchannels(), sound.getframerate(), sound.getnframes()) == (2, 8000, result.audio.shape[1])
        samples = np.frombuffer(sound.readframes(sound.getnframes()), dtype="<i2").reshape(-1, 2).T
    assert np.abs(samples / 32767 - result.audio.numpy()).max() < 1 / 32767


def test_a_frame_rate_the_soundtrack_was_not_made_for_is_refused(clip, tmp_path, capsys):
    """--fps other than the 24 frames a second LTX-2 makes its sound for would drift the pictures from the sound:
    refused before any weight loads (and by Generation.save); 24 is what it is anyway."""
    result, args = clip
    assert main([*args, "--fps", "30", "--out", str(tmp_path / "fast.gif")]) != 0
    assert "--fps 30: LTX2Pipeline makes its soundtrack for 24 frames a second" in capsys.readouterr().err
    assert not (tmp_path / "fast.gif").exists()
    with pytest.raises(MemfitError, match="drift from the sound"):
        result.save(tmp_path / "fast.webp", frames_per_second=30)
    assert result.save(tmp_path / "same.webp", frames_per_second=24).exists()


def test_a_silent_video_writes_no_soundtrack(tiny_models, tmp_path):
    av = pytest.importorskip("av")
    out = tmp_path / "clip.mp4"
    assert main(["generate", "--model", tiny_models("ltx"), "--prompt", PROMPT, "--steps", "1", "--width", "32",
                 "--height", "32", "--frames", "5", "--quiet", "--out", str(out)]) == 0
    with av.open(str(out)) as container:
        assert not container.streams.audio
    assert not (tmp_path / "clip.wav").exists()


def test_frames_sizes_and_guidance(model):
    """__call__'s defaults (768x512, 121 frames); the real VAE's 32x and 8x in time; the audio's own guidance (7)
    makes every run guided, --guidance 1 too. Frames and sizes it cannot take are refused as LTX-Video's are
    (tests/test_ltx.py)."""
    adapter = ModelFolder.open(model).adapter
    settings = adapter.resolve(PROMPT, None, None, None, 0, None, None)
    assert (settings.width, settings.height, settings.num_frames, settings.guidance) == (768, 512, 121, 3.0)
    assert adapter.guided(adapter.resolve(PROMPT, None, 2, 1.0, 0, 32, 32, num_frames=9))
    adapter.configs["vae"].update(patch_size=4, spatio_temporal_scaling=[True, True, True, True])
    assert (adapter.vae_scale_factor(), adapter.temporal_scale_factor(), adapter.size_multiple()) == (64, 16, 64)
    adapter.configs["vae"].update(spatial_compression_ratio=32, temporal_compression_ratio=8)  # the real one states them
    assert (adapter.vae_scale_factor(), adapter.temporal_scale_factor(), adapter.latent_frames(settings)) == (32, 8, 16)


def test_plan_places_each_stage(model, capsys):
    """memfit plan --model plans Gemma-3 alone, the connectors with the transformer, and the three decoders, from
    the configs (the connectors and the vocoder are classes of diffusers' ltx2 pipeline package)."""
    assert main(["plan", "--model", model, "--budget", "8GiB", "--json"]) == 0
    stages = {stage["name"]: stage for stage in json.loads(capsys.readouterr().out)["plan"]["stages"]}
    assert {name: {p["component"] for p in stage["placements"]} for name, stage in stages.items()} == {
        "encode": {"text_encoder"}, "denoise": {"connectors", "transformer"},
        "decode": {"vae", "audio_vae", "vocoder"}}


# ---- image to video (LTX2ImageToVideoPipeline) ---------------------------------------------------------------------

IMAGE = picture(32, seed=1)
I2V = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=2, guidance=3.0, seed=7, num_frames=9, width=32, height=32,
           image=IMAGE)


def _plain_image_to_video(model, settings, image):
    """Plain diffusers' video and soundtrack: the folder loaded as LTX2ImageToVideoPipeline, as diffusers' example does
    (its image CRF is the one it would read from its text encoder: the adapter's call_kwargs pass it)."""
    pipe = diffusers.LTX2ImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    output = pipe(prompt=settings.prompt, image=image, negative_prompt=settings.negative_prompt,
                  **ModelFolder.open(model).adapter.call_kwargs(settings),
                  generator=torch.Generator().manual_seed(settings.seed), output_type="pil")
    assert pipe.text_encoder is not None and ModelFolder.open(model).adapter.image_crf() == \
        resolve_default_image_crf(pipe.text_encoder)
    return list(output.frames[0]), output.audio[0]


def test_image_to_video_equals_plain_diffusers(model):
    ours = memfit.generate(model=model, progress=False, **I2V)
    assert [stage.stage for stage in ours.report.stages] == ["encode", "denoise", "decode"]
    assert ours.settings.task == "img2img" and len(ours.frames) == 9
    frames, audio = _plain_image_to_video(model, ours.settings, IMAGE)
    assert max_pixel_difference(ours.frames, frames) == 0 and bool((ours.audio == audio).all())
    other = memfit.generate(model=model, progress=False, **dict(I2V, image=picture(32, seed=2)))
    assert max_pixel_difference(ours.frames, other.frames) > 0


def test_image_to_video_streams_and_plans_the_vaes_encoder(model, streamed_plans, tmp_path, monkeypatch):
    budget = smallest_budget(model=model, **dict(I2V, steps=1))
    streamed_plans.clear()
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    ours = memfit.generate(model=model, progress=False, budget=budget, **I2V)
    stages = {plan.stages[0].name: plan.stages[0] for plan in streamed_plans}
    assert stages["denoise"].streamed_from_disk_bytes > 0
    assert {placement.component for placement in stages["denoise"].placements} == {"connectors", "transformer", "vae"}
    frames, audio = _plain_image_to_video(model, ours.settings, IMAGE)
    assert max_pixel_difference(ours.frames, frames) == 0 and bool((ours.audio == audio).all())


def test_image_to_video_size_is_the_images_aspect(model):
    """Without --width/--height: the image's aspect ratio at the area of 768x512, each side a multiple of 32."""
    adapter = ModelFolder.open(model).adapter
    wide = Conditioning(image=IMAGE.resize((96, 48)))
    settings = adapter.resolve(PROMPT, None, 2, None, 0, None, None, conditioning=wide, num_frames=9)
    assert (settings.width, settings.height) == (864, 416)


def test_a_folder_saved_as_the_image_to_video_class(tiny_models):
    model = tiny_models("ltx2_i2v")
    ours, _ = assert_matches_diffusers(model, atol=0, **I2V)  # the oracle compares the soundtrack too
    assert ours.settings.task == "img2img" and ours.metadata["pipeline"] == "LTX2ImageToVideoPipeline"
    with pytest.raises(MemfitError, match=r"makes a video from an image: pass --image IMG"):
        memfit.generate(model=model, progress=False, **dict(I2V, image=None))


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRAs need peft (pip install memfit[lora])")
def test_a_lora_goes_into_the_transformer(model, tmp_path):
    """--lora through the pipeline's own load_lora_weights: plain diffusers' video and soundtrack with it, another
    video without it."""
    from memfit.models.lora import check_loras
    from memfit.testing.conditioning import save_lora

    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    ours = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, progress=False, loras=loras, **VIDEO)
    assert "LoRA(s), unfused" in ours.report.stages[1].note
    reference = diffusers_output(model, ours.settings, loras=check_loras(loras))
    assert max_pixel_difference(ours.frames, reference) == 0 and _same_soundtrack(ours, reference)
    assert max_pixel_difference(diffusers_output(model, ours.settings), reference) > 0
