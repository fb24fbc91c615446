"""The pipeline families added after SD/SDXL/Lumina2/CogView4: staged generation equals plain diffusers.

For each family (a tiny pipeline from memfit.testing.pipelines), at fp32 on CPU, bitwise:
- memfit.generate equals DiffusionPipeline.from_pretrained(folder)(same arguments, seeded generator),
  with guidance off and on (true CFG for Flux);
- the same with a budget small enough that part of every stage's weights streams from disk;
- positive and negative embeddings of different lengths (memfit.encode, then a shortened negative)
  give the image the adapter's rule promises (each adapter's `unequal_lengths`).
"""

import dataclasses
import gc
import json

import re

import pytest
import torch

import memfit
from memfit.run.embeddings import Embeddings
from memfit.models.folder import ModelFolder
from conftest import smallest_budget, with_staging_ring
from memfit.testing import (PIPELINE_KINDS, assert_matches_diffusers, diffusers_output, generated_output,
                            max_pixel_difference)
from memfit.testing import conditioning
from memfit.testing.conditioning import test_image

PROMPT = "a red house near the sea"
NEGATIVE = "blurry"
BASE = dict(prompt=PROMPT, steps=2, seed=7, width=32, height=32)
KONTEXT_IMAGE = test_image(32, seed=1)
FILL = dict(image=test_image(32, seed=1), mask=conditioning.test_mask(32))  # FLUX.1 Fill repaints the mask's white square
EDIT_IMAGE = test_image(64, seed=1)  # the tiny Qwen-Image-Edit's sides are multiples of 64

# kind -> (settings without guidance, settings with guidance); None where a family has no guidance.
CASES = {
    "flux": (dict(guidance=3.5), dict(guidance=3.5, true_cfg_scale=4.0, negative_prompt=NEGATIVE)),
    "flux_schnell": (dict(guidance=0.0), dict(guidance=0.0, true_cfg_scale=4.0, negative_prompt=NEGATIVE)),
    "sd3": (dict(guidance=1.0), dict(guidance=4.5, negative_prompt=NEGATIVE)),
    "qwenimage": (dict(guidance=1.0), dict(guidance=4.0, negative_prompt=NEGATIVE)),
    "wan": (dict(guidance=1.0, num_frames=5), dict(guidance=5.0, negative_prompt=NEGATIVE, num_frames=5)),
    "chroma": (dict(guidance=1.0), dict(guidance=5.0, negative_prompt=NEGATIVE)),
    "sana": (dict(guidance=1.0), dict(guidance=4.5, negative_prompt=NEGATIVE)),
    "pixart_sigma": (dict(guidance=1.0), dict(guidance=4.5, negative_prompt=NEGATIVE)),
    "aura_flow": (dict(guidance=1.0), dict(guidance=3.5, negative_prompt=NEGATIVE)),
    "hidream": (dict(guidance=1.0), dict(guidance=5.0, negative_prompt=NEGATIVE)),
    # Z-Image guides whenever guidance > 0 (Turbo runs at 0)
    "zimage": (dict(guidance=0.0), dict(guidance=4.0, negative_prompt=NEGATIVE)),
    # Kontext edits an input image (the img2img task)
    "flux_kontext": (dict(guidance=3.5, image=KONTEXT_IMAGE),
                     dict(guidance=3.5, true_cfg_scale=4.0, negative_prompt=NEGATIVE, image=KONTEXT_IMAGE)),
    # FLUX.1 Fill inpaints (image and mask on every run); its guidance is embedded only: no negative prompt
    "flux_fill": (dict(guidance=3.5, **FILL), dict(guidance=30.0, **FILL)),
    # Qwen-Image-Edit (and Plus) edits an input image, which its text encoder sees with the prompt too
    "qwenimage_edit": (dict(guidance=1.0, image=EDIT_IMAGE, width=64, height=64),
                       dict(guidance=4.0, negative_prompt=NEGATIVE, image=EDIT_IMAGE, width=64, height=64)),
    "qwenimage_edit_plus": (dict(guidance=1.0, image=EDIT_IMAGE, width=64, height=64),
                            dict(guidance=4.0, negative_prompt=NEGATIVE, image=EDIT_IMAGE, width=64, height=64)),
    # FLUX.2 dev's guidance is embedded only: no negative pass, no negative prompt
    "flux2": (dict(guidance=1.0), dict(guidance=4.0)),
    "flux2_klein": (dict(guidance=1.0), dict(guidance=4.0, negative_prompt=NEGATIVE)),
    # HunyuanImage's guidance is its guiders' scale (3.5 in the tiny folder): both runs change it
    "hunyuan_image": (dict(guidance=1.0), dict(guidance=4.0, negative_prompt=NEGATIVE)),
    # Wan 2.2 A14B: two experts, the second from the boundary on (guidance_scale_2 is the folder's)
    "wan22": (dict(guidance=1.0, num_frames=5), dict(guidance=5.0, negative_prompt=NEGATIVE, num_frames=5)),
    # HunyuanVideo 1.5's guidance is its guider's scale too (6.0 in the tiny folder)
    "hunyuan_video15": (dict(guidance=1.0, num_frames=5), dict(guidance=4.0, negative_prompt=NEGATIVE, num_frames=5)),
    "ltx": (dict(guidance=1.0, num_frames=5), dict(guidance=3.0, negative_prompt=NEGATIVE, num_frames=5)),
    # LTX-2 guides its audio whatever --guidance is (audio_guidance_scale 7): both runs have a negative pass
    "ltx2": (dict(guidance=1.0, num_frames=9), dict(guidance=3.0, negative_prompt=NEGATIVE, num_frames=9)),
}


def _settings(kind, guided):
    return dict(BASE, **CASES[kind][guided])


@pytest.mark.slow  # every family end to end: `make test` runs it
@pytest.mark.parametrize("guided", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("kind", list(CASES))
def test_equals_diffusers(tiny_models, kind, guided):
    ours, _ = assert_matches_diffusers(tiny_models(kind), atol=0, **_settings(kind, guided))
    assert [stage.stage for stage in ours.report.stages] == ["encode", "denoise", "decode"]


@pytest.mark.slow  # every family end to end: `make test` runs it
@pytest.mark.parametrize("kind", list(CASES))
def test_the_oracle_can_fail(tiny_models, kind):
    """A different seed, and guidance on instead of off, each give a different image."""
    model = tiny_models(kind)
    ours = memfit.generate(model=model, progress=False, **_settings(kind, True))
    other_seed = diffusers_output(model, dataclasses.replace(ours.settings, seed=8), **_images(CASES[kind][True]))
    assert max_pixel_difference(generated_output(ours), other_seed) > 0
    unguided = memfit.generate(model=model, progress=False, **_settings(kind, False))
    assert max_pixel_difference(generated_output(ours), generated_output(unguided)) > 0


def _images(settings):
    """The input images of ``settings`` (memfit.generate's image and mask) as the plain pipeline's arguments."""
    return {name: settings[key] for key, name in (("image", "image"), ("mask", "mask_image")) if key in settings}


def _smallest_budget(model, settings):
    """The smallest budget every stage can be planned in (each stage's largest blocks in flight)."""
    return smallest_budget(model=model, **dict(settings, steps=1))


def _weight_bytes(model, names):
    return sum(path.stat().st_size for name in names for path in (ModelFolder.open(model).path / name).glob("*.safetensors"))


@pytest.mark.slow  # every family end to end: `make test` runs it
@pytest.mark.parametrize("kind", list(CASES))
def test_streaming_budget_keeps_the_image(tiny_models, kind, streamed_plans, tmp_path, monkeypatch):
    _streams_and_matches_diffusers(tiny_models(kind), kind, streamed_plans, tmp_path, monkeypatch)


@pytest.mark.slow  # every family end to end on the fake GPU: `make test` runs it
@pytest.mark.parametrize("kind", list(CASES))
def test_streaming_budget_keeps_the_image_on_a_fake_gpu(tiny_models, kind, streamed_plans, tmp_path, monkeypatch):
    """The same run on "cuda" through the lazy fake CUDA runtime (memfit.testing.fake_cuda): copies
    complete only when waited for, so a missing wait anywhere in the GPU path changes the image."""
    from memfit.testing.fake_cuda import fake_cuda

    with fake_cuda(lazy=True) as gpu:
        _streams_and_matches_diffusers(tiny_models(kind), kind, streamed_plans, tmp_path, monkeypatch, device="cuda")
        gc.collect()  # each stage's pipeline is dropped when the stage ends, and with it its pinned memory
        assert gpu.copies > 0 and gpu.pinned_bytes() == 0  # it ran on the fake GPU, and gave its pinned memory back


def _streams_and_matches_diffusers(model, kind, streamed_plans, tmp_path, monkeypatch, device=None):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))  # no prompt-cache hit: the encoders load
    adapter = ModelFolder.open(model).adapter
    settings = _settings(kind, True)
    budget = _smallest_budget(model, settings)
    assert budget < _weight_bytes(model, adapter.denoise_components)
    streamed_plans.clear()
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "fresh-cache"))  # the runs above cached the prompt
    if device is None:
        ours, _ = assert_matches_diffusers(model, atol=0, budget=budget, **settings)
    else:  # on a GPU the weights would park in pinned host RAM: a host budget for the staging ring alone sends them to disk
        ours, _ = with_staging_ring(lambda gpu_budget: assert_matches_diffusers(
            model, atol=0, budget=gpu_budget, device=device, **settings), budget, model)
    assert ours.settings.negative_prompt == settings.get("negative_prompt")
    # On a GPU the host budget the staging ring takes may hold some of the blocks: they stream from the host.
    streamed = {}
    for plan in streamed_plans:  # a stage whose components run one at a time (Wan 2.2's experts) plans "STAGE:PHASE"s
        for phase in plan.stages:
            stage = phase.name.split(":")[0]
            streamed[stage] = streamed.get(stage, 0) + phase.streamed_from_disk_bytes + phase.streamed_from_host_bytes
    assert set(streamed) == {"encode", "denoise", "decode"} and streamed["denoise"] > 0, streamed


@pytest.mark.parametrize("kind", list(CASES))
def test_text_encoders_stream_from_disk(tiny_models, kind, streamed_plans, tmp_path, monkeypatch):
    """Every transformers text encoder the families use reads its weights straight from its files,
    whatever names transformers gives them once loaded (Qwen2.5-VL's differ from the file's)."""
    from memfit.errors import MemfitError

    model = tiny_models(kind)
    negative = CASES[kind][True].get("negative_prompt")  # FLUX.2 dev takes none
    # Qwen-Image-Edit's text encoder sees the image too (its vision tower streams as well)
    image = {"image": CASES[kind][True]["image"]} if ModelFolder.open(model).adapter.prompt_sees_image else {}
    whole, _ = memfit.encode(PROMPT, model=model, negative_prompt=negative, **image)
    budget = 1
    for attempt in range(4):
        monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / f"cache{attempt}"))  # no prompt-cache hit
        try:
            streamed_plans.clear()
            low, _ = memfit.encode(PROMPT, model=model, negative_prompt=negative, budget=budget, **image)
            break
        except MemfitError as exc:
            budget = int(re.search(r"smallest budget that works is (\d+) bytes", str(exc)).group(1))
    assert streamed_plans[-1].stages[0].streamed_from_disk_bytes > 0
    assert whole.tensors.keys() == low.tensors.keys()
    for name, tensor in whole.tensors.items():
        assert torch.equal(tensor, low.tensors[name]), name


def _embeddings(model, tensors):
    folder = ModelFolder.open(model)
    return Embeddings(tensors, folder.class_name, folder.text_fingerprint, PROMPT, NEGATIVE)


@pytest.mark.parametrize("kind", ["flux", "flux_schnell"])
def test_flux_unequal_lengths(tiny_models, kind, monkeypatch):
    """Flux's passes are separate; the padding memfit adds for the pipeline's shape check never
    reaches the transformer: padding with noise instead of zeros gives the same image, and the
    trimming path with nothing to trim is the pipeline's own path."""
    import memfit.models.families.base as families_base
    import memfit.models.families.flux as flux

    model = tiny_models(kind)
    settings = _settings(kind, True)
    del settings["prompt"], settings["negative_prompt"]
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    full = embeddings.tensors
    assert full["prompt_embeds"].shape[1] == full["negative_prompt_embeds"].shape[1] == 512
    short = dict(full)
    short["negative_prompt_embeds"] = full["negative_prompt_embeds"][:, :48]
    first = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    assert any("512 (positive) and 48 (negative)" in note for note in first.report.notes)
    # The negative really is shorter: the image differs from the full-length one.
    whole = memfit.generate(model=model, embeddings=_embeddings(model, full), progress=False, **settings)
    assert max_pixel_difference(first.images, whole.images) > 0

    def noisy_pad(tensor, length, dim=1):
        shape = list(tensor.shape)
        shape[dim] = length - tensor.shape[dim]
        return torch.cat([tensor, 100 * torch.randn(shape)], dim=dim) if shape[dim] > 0 else tensor

    monkeypatch.setattr(families_base, "pad_to_length", noisy_pad)  # the padding PipelineAdapter.pad_to_longest does
    second = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    assert max_pixel_difference(first.images, second.images) == 0

    # Equal lengths through the trimming wrapper (cut to the full length) equal the plain pipeline.
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe(**full, num_inference_steps=2, guidance_scale=settings["guidance"], true_cfg_scale=4.0, width=32,
                    height=32, generator=torch.Generator().manual_seed(7)).images

    plain = run()
    with flux.trim_padded_text(pipe.transformer, {id(full["negative_prompt_embeds"]): 512}):
        trimmed = run()
    assert "forward" not in vars(pipe.transformer)
    assert max_pixel_difference(plain, trimmed) == 0
    assert max_pixel_difference(plain, whole.images) == 0  # and memfit with embeddings equals diffusers


@pytest.mark.parametrize("kind, full_length", [("sd3", 77 + 256), ("aura_flow", 256)])
def test_unequal_lengths_split_passes(tiny_models, kind, full_length, monkeypatch):
    """SD3 and AuraFlow batch their guidance passes; unequal lengths run as two transformer calls.
    The padding memfit adds never reaches the transformer (noise padding gives the same image), and
    with equal lengths the split path computes what the pipeline's batched path does."""
    import importlib

    import numpy as np
    import diffusers

    import memfit.models.families.base as families_base

    adapter_module = importlib.import_module(f"memfit.models.families.{kind}")
    model = tiny_models(kind)
    guidance = CASES[kind][True]["guidance"]
    settings = dict(steps=2, guidance=guidance, seed=7, width=32, height=32)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    full = embeddings.tensors
    assert full["prompt_embeds"].shape[1] == full["negative_prompt_embeds"].shape[1] == full_length
    short = dict(full, negative_prompt_embeds=full["negative_prompt_embeds"][:, :120])
    if "negative_prompt_attention_mask" in full:  # AuraFlow's mask is the embedding's, flattened: [B, L * D]
        short["negative_prompt_attention_mask"] = full["negative_prompt_attention_mask"][:, :120 * full["prompt_embeds"].shape[2]]
    first = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    assert any(f"{full_length} (positive) and 120 (negative)" in note for note in first.report.notes)
    whole = memfit.generate(model=model, embeddings=_embeddings(model, full), progress=False, **settings)

    def noisy_pad(tensor, length, dim=1):
        shape = list(tensor.shape)
        shape[dim] = length - tensor.shape[dim]
        return torch.cat([tensor, 100 * torch.randn(shape)], dim=dim) if shape[dim] > 0 else tensor

    with monkeypatch.context() as patch:
        # Every padding memfit does for this family: the shared embeddings padding, and the
        # family's own (AuraFlow's masks).
        patch.setattr(families_base, "pad_to_length", noisy_pad)
        if hasattr(adapter_module, "pad_to_length"):
            patch.setattr(adapter_module, "pad_to_length", noisy_pad)
        second = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    assert max_pixel_difference(first.images, second.images) == 0

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def run(output_type):
        return pipe(**full, num_inference_steps=2, guidance_scale=guidance, width=32, height=32,
                    generator=torch.Generator().manual_seed(7), output_type=output_type).images

    assert max_pixel_difference(run("pil"), whole.images) == 0  # memfit with embeddings equals diffusers
    batched = run("np")
    with families_base.split_transformer_passes(pipe.transformer, full_length, full_length):
        split = run("np")
    assert "forward" not in vars(pipe.transformer)
    np.testing.assert_allclose(split, batched, rtol=0, atol=1e-5)
    with families_base.split_transformer_passes(pipe.transformer, 120, full_length):
        cut = run("np")
    assert np.abs(cut - batched).max() > 1e-5  # the negative pass really saw only 120 tokens


def test_qwenimage_unequal_lengths_are_native(tiny_models, tmp_path):
    """QwenImage embeds each prompt at its own length; through an embeddings file the image equals
    plain diffusers' one-shot image from the prompts, and cutting the negative changes it."""
    model = tiny_models("qwenimage")
    settings = dict(steps=2, guidance=4.0, seed=7, width=32, height=32)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    positive, negative = embeddings.tensors["prompt_embeds"], embeddings.tensors["negative_prompt_embeds"]
    assert positive.shape[1] > negative.shape[1]
    path = embeddings.save(tmp_path / "prompt.safetensors")
    ours = memfit.generate(model=model, embeddings=path, progress=False, **settings)
    assert any(f"{positive.shape[1]} (positive) and {negative.shape[1]} (negative)" in note for note in ours.report.notes)
    reference = diffusers_output(model, ours.settings)
    assert max_pixel_difference(ours.images, reference) == 0

    cut = dict(embeddings.tensors, negative_prompt_embeds=negative[:, :-1])
    cut.pop("negative_prompt_embeds_mask", None)
    shorter = memfit.generate(model=model, embeddings=_embeddings(model, cut), progress=False, **settings)
    assert max_pixel_difference(shorter.images, ours.images) > 0


def test_hunyuan_image_embeddings_round_trip_and_unequal_lengths_are_native(tiny_models, tmp_path):
    """HunyuanImage's embeddings (Qwen2.5-VL and ByT5, each with its mask) saved by memfit encode and
    given back with --embeddings draw plain diffusers' image from the prompts; a negative cut shorter
    than the positive in both sequences goes through as it is (the guider's passes are separate
    transformer calls) and equals plain diffusers given the same embeddings, and differs from the whole."""
    import diffusers

    model = tiny_models("hunyuan_image")
    settings = dict(steps=2, guidance=4.0, seed=7, width=32, height=32)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    full = embeddings.tensors
    assert set(full) == {f"{prefix}prompt_embeds{part}" for prefix in ("", "negative_")
                         for part in ("", "_mask", "_2", "_mask_2")}
    assert full["prompt_embeds"].shape[1] == 1000 and full["prompt_embeds_2"].shape[1] == 128
    assert not full["prompt_embeds_2"].any()  # no quoted text: the glyph embeddings are zero
    path = embeddings.save(tmp_path / "prompt.safetensors")
    ours = memfit.generate(model=model, embeddings=path, progress=False, **settings)
    assert max_pixel_difference(ours.images, diffusers_output(model, ours.settings)) == 0

    valid = int(full["negative_prompt_embeds_mask"].sum())
    assert 0 < valid < 48

    def cut_negative(length):
        cut = dict(full)
        for name, kept in (("prompt_embeds", length), ("prompt_embeds_mask", length), ("prompt_embeds_2", 16),
                           ("prompt_embeds_mask_2", 16)):
            cut[f"negative_{name}"] = full[f"negative_{name}"][:, :kept]
        return cut

    # Cut to 48 tokens, the negative loses only padding its mask hides: the image is the whole one's.
    shorter = memfit.generate(model=model, embeddings=_embeddings(model, cut_negative(48)), progress=False, **settings)
    assert any("1000 (positive) and 48 (negative)" in note for note in shorter.report.notes)
    assert max_pixel_difference(shorter.images, ours.images) == 0
    # Cut into its words, it is a different negative, and still plain diffusers' image given the same embeddings.
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    pipe.guider, pipe.ocr_guider = pipe.guider.new(guidance_scale=4.0), pipe.ocr_guider.new(guidance_scale=4.0)
    cut = cut_negative(valid - 2)
    fewer = memfit.generate(model=model, embeddings=_embeddings(model, cut), progress=False, **settings)
    reference = pipe(**cut, num_inference_steps=2, width=32, height=32, generator=torch.Generator().manual_seed(7)).images
    assert max_pixel_difference(fewer.images, reference) == 0
    assert max_pixel_difference(fewer.images, ours.images) > 0


def test_hunyuan_image_guidance_is_its_guiders_scale(tiny_models):
    """Without --guidance a run takes the guider's own scale and runs both guiders as the folder has
    them; --guidance rebuilds both at that scale for the run only; a prompt with quoted text runs the
    ByT5 encoder and the OCR guider, equal to plain diffusers."""
    model = tiny_models("hunyuan_image")
    adapter = ModelFolder.open(model).adapter
    settings = adapter.resolve(PROMPT, None, 2, None, 7, 32, 32)
    assert settings.guidance == 3.5 and adapter.guided(settings)
    assert not adapter.guided(adapter.resolve(PROMPT, None, 2, 1.0, 7, 32, 32))
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    assert adapter.call_components(pipe, settings) == {}
    rebuilt = adapter.call_components(pipe, dataclasses.replace(settings, guidance=6.0))
    assert {name: guider.guidance_scale for name, guider in rebuilt.items()} == {"guider": 6.0, "ocr_guider": 6.0}
    assert pipe.guider.guidance_scale == 3.5  # the pipeline's own are left as they are

    quoted = 'a sign that says "open"'
    embeddings, _ = memfit.encode(quoted, model=model)
    assert embeddings.tensors["prompt_embeds_2"].any() and embeddings.tensors["prompt_embeds_mask_2"].sum() > 0
    ours, _ = assert_matches_diffusers(model, atol=0, **dict(BASE, prompt=quoted))
    default, _ = assert_matches_diffusers(model, atol=0, **BASE)
    assert ours.settings.guidance == default.settings.guidance == 3.5
    assert max_pixel_difference(ours.images, default.images) > 0


def test_wan_unequal_lengths_are_native(tiny_models):
    """Wan's passes are separate transformer calls without a text mask: a negative embedding cut to
    48 tokens goes through unchanged, and the frames equal plain diffusers' given the same embeddings."""
    import diffusers

    model = tiny_models("wan")
    settings = dict(steps=2, guidance=5.0, seed=7, width=32, height=32, num_frames=5)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    cut = dict(embeddings.tensors, negative_prompt_embeds=embeddings.tensors["negative_prompt_embeds"][:, :48])
    ours = memfit.generate(model=model, embeddings=_embeddings(model, cut), progress=False, **settings)
    assert any("512 (positive) and 48 (negative)" in note for note in ours.report.notes)
    assert len(ours.frames) == 5 and ours.images == []

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(**cut, num_inference_steps=2, guidance_scale=5.0, width=32, height=32, num_frames=5,
                     generator=torch.Generator().manual_seed(7), output_type="pil").frames[0]
    assert max_pixel_difference(ours.frames, list(reference)) == 0
    whole = memfit.generate(model=model, embeddings=_embeddings(model, embeddings.tensors), progress=False, **settings)
    assert max_pixel_difference(ours.frames, whole.frames) > 0


def test_chroma_unequal_lengths_are_native(tiny_models):
    """Chroma's passes are separate, each with its own mask and text ids: a negative embedding and
    mask cut to 48 tokens go through unchanged, and the image equals plain diffusers' given the same."""
    import diffusers

    model = tiny_models("chroma")
    settings = dict(steps=2, guidance=5.0, seed=7, width=32, height=32)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    full = embeddings.tensors
    cut = dict(full, negative_prompt_embeds=full["negative_prompt_embeds"][:, :48],
               negative_prompt_attention_mask=full["negative_prompt_attention_mask"][:, :48])
    ours = memfit.generate(model=model, embeddings=_embeddings(model, cut), progress=False, **settings)
    assert any("512 (positive) and 48 (negative)" in note for note in ours.report.notes)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(**cut, num_inference_steps=2, guidance_scale=5.0, width=32, height=32,
                     generator=torch.Generator().manual_seed(7)).images
    assert max_pixel_difference(ours.images, reference) == 0
    other_seed = pipe(**cut, num_inference_steps=2, guidance_scale=5.0, width=32, height=32,
                      generator=torch.Generator().manual_seed(8)).images
    assert max_pixel_difference(ours.images, other_seed) > 0


@pytest.mark.parametrize("kind", ["zimage", "flux_kontext", "flux_fill", "flux2", "flux2_klein"])
def test_embeddings_file_equals_diffusers(tiny_models, kind, tmp_path):
    """memfit encode, then generate from the file (Kontext with its input image, Fill with its image and mask):
    the image plain diffusers makes from the prompts, without the encode stage."""
    model = tiny_models(kind)
    settings = _settings(kind, True)
    del settings["prompt"]
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=settings.pop("negative_prompt", None))
    positive = embeddings.tensors["prompt_embeds"]
    negative = embeddings.tensors.get("negative_prompt_embeds", positive)  # FLUX.2 dev encodes no negative
    ours = memfit.generate(model=model, embeddings=embeddings.save(tmp_path / "prompt.safetensors"), progress=False,
                           **settings)
    assert [stage.stage for stage in ours.report.stages] == ["denoise", "decode"]
    if positive.shape[1] != negative.shape[1]:  # Z-Image embeds each prompt at its own length
        assert any(f"{positive.shape[1]} (positive) and {negative.shape[1]} (negative)" in note
                   for note in ours.report.notes)
    assert max_pixel_difference(ours.images, diffusers_output(model, ours.settings, **_images(settings))) == 0


def test_zimage_guides_above_zero(tiny_models):
    """ZImagePipeline guides whenever guidance > 0, with "" as the negative prompt where none is given;
    its defaults are its __call__'s."""
    model = tiny_models("zimage")
    adapter = ModelFolder.open(model).adapter
    assert adapter.guided(adapter.resolve(PROMPT, None, 2, 0.5, 0, 32, 32))
    assert not adapter.guided(adapter.resolve(PROMPT, NEGATIVE, 2, 0.0, 0, 32, 32))
    settings = adapter.resolve(PROMPT, None, None, None, 0, None, None)
    assert (settings.steps, settings.guidance, settings.width, settings.height) == (50, 5.0, 256, 256)  # VAE scale 2
    ours, _ = assert_matches_diffusers(model, atol=0, **dict(BASE, guidance=0.5))
    assert [stage.stage for stage in ours.report.stages] == ["encode", "denoise", "decode"]


def test_kontext_edits_the_input_image(tiny_models):
    """FLUX.1 Kontext takes --image as its img2img task: the VAE's encoder runs in the denoise stage, the
    output has the input's size unless asked otherwise, the image changes the output, --strength is refused."""
    from memfit.errors import MemfitError

    model = tiny_models("flux_kontext")
    settings = dict(steps=2, guidance=3.5, seed=7)
    ours = memfit.generate(PROMPT, model=model, image=KONTEXT_IMAGE, progress=False, **settings)
    assert ours.settings.task == "img2img" and ours.images[0].size == KONTEXT_IMAGE.size
    stages = {stage.stage: stage for stage in ours.report.stages}
    assert list(stages) == ["encode", "denoise", "decode"] and "vae" in stages["denoise"].components
    prompt_only = memfit.generate(PROMPT, model=model, width=32, height=32, progress=False, **settings)
    assert prompt_only.settings.task == "text2img"
    # The denoise stage's activation estimate counts the input image's tokens (about 1024 x 1024 pixels, 32 a side).
    adapter = ModelFolder.open(model).adapter
    assert adapter.context_tokens(prompt_only.settings) == 512 < 512 + 1000 < adapter.context_tokens(ours.settings)
    assert max_pixel_difference(ours.images, prompt_only.images) > 0
    with pytest.raises(MemfitError, match="FluxKontextPipeline takes no --strength"):
        memfit.generate(PROMPT, model=model, image=KONTEXT_IMAGE, strength=0.5, progress=False, **settings)


@pytest.mark.parametrize("kind", ["flux2", "flux2_klein"])
def test_flux2_takes_a_reference_image(tiny_models, kind):
    """FLUX.2 takes --image as its img2img task, as plain diffusers' image=: the VAE's encoder runs in the
    denoise stage, the output has the input's size, the image changes the output, --strength is refused."""
    from memfit.errors import MemfitError

    model = tiny_models(kind)
    reference = test_image(64, seed=1)  # the pipelines take reference images of 64 pixels a side or more
    settings = dict(_settings(kind, True), width=None, height=None, image=reference)
    ours, _ = assert_matches_diffusers(model, atol=0, **settings)
    assert ours.settings.task == "img2img" and ours.images[0].size == reference.size
    stages = {stage.stage: stage for stage in ours.report.stages}
    assert list(stages) == ["encode", "denoise", "decode"] and "vae" in stages["denoise"].components
    prompt_only = memfit.generate(model=model, progress=False, **dict(_settings(kind, True), width=64, height=64))
    assert max_pixel_difference(ours.images, prompt_only.images) > 0
    adapter = ModelFolder.open(model).adapter
    assert adapter.context_tokens(prompt_only.settings) == 512 < adapter.context_tokens(ours.settings)
    with pytest.raises(MemfitError, match="takes no --strength"):
        memfit.generate(model=model, strength=0.5, progress=False, **settings)
    with pytest.raises(MemfitError, match="cannot take this --image: Image too small: 32×32"):
        memfit.generate(model=model, progress=False, **dict(settings, image=KONTEXT_IMAGE))


def test_flux2_dev_guidance_is_embedded_only(tiny_models):
    """FLUX.2 dev never runs a negative pass: a negative prompt is refused, naming the flag; encoding makes
    no negative branch; guidance still changes the image (test_the_oracle_can_fail)."""
    from memfit.errors import MemfitError

    model = tiny_models("flux2")
    with pytest.raises(MemfitError, match="Flux2Pipeline takes no negative prompt.*--negative-prompt"):
        memfit.generate(model=model, negative_prompt=NEGATIVE, progress=False, **_settings("flux2", True))
    embeddings, _ = memfit.encode(PROMPT, model=model)
    assert set(embeddings.tensors) == {"prompt_embeds"}
    assert embeddings.tensors["prompt_embeds"].shape[1] == 512
    adapter = ModelFolder.open(model).adapter
    assert not adapter.guided(adapter.resolve(PROMPT, None, 2, 4.0, 0, 32, 32))


def test_flux2_klein_guidance(tiny_models):
    """FLUX.2 klein guides above 1 unless model_index.json says it is step-distilled; its passes are
    separate, so a negative cut to 48 tokens goes through as it is and equals plain diffusers given the same."""
    import diffusers

    model = tiny_models("flux2_klein")
    folder = ModelFolder.open(model)
    adapter = folder.adapter
    assert adapter.pipeline_options == {"is_distilled": False}
    assert adapter.guided(adapter.resolve(PROMPT, None, 2, 4.0, 0, 32, 32))
    assert not adapter.guided(adapter.resolve(PROMPT, NEGATIVE, 2, 1.0, 0, 32, 32))
    adapter.pipeline_options["is_distilled"] = True
    assert not adapter.guided(adapter.resolve(PROMPT, NEGATIVE, 2, 4.0, 0, 32, 32))

    settings = dict(steps=2, guidance=4.0, seed=7, width=32, height=32)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    cut = dict(embeddings.tensors, negative_prompt_embeds=embeddings.tensors["negative_prompt_embeds"][:, :48])
    ours = memfit.generate(model=model, embeddings=_embeddings(model, cut), progress=False, **settings)
    assert any("512 (positive) and 48 (negative)" in note for note in ours.report.notes)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(**cut, num_inference_steps=2, guidance_scale=4.0, width=32, height=32,
                     generator=torch.Generator().manual_seed(7)).images
    assert max_pixel_difference(ours.images, reference) == 0
    whole = memfit.generate(model=model, embeddings=_embeddings(model, embeddings.tensors), progress=False, **settings)
    assert max_pixel_difference(ours.images, whole.images) > 0


@pytest.mark.parametrize("kind", ["sana", "pixart_sigma"])
def test_masked_padding_equals_full_length(tiny_models, kind):
    """Sana and PixArt-Sigma pad a shorter embedding with masked zeros: a negative cut to 48 tokens
    (all its valid tokens) gives the image plain diffusers makes from the full-length negative."""
    import diffusers

    model = tiny_models(kind)
    settings = dict(steps=2, guidance=4.5, seed=7, width=32, height=32)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    full = embeddings.tensors
    assert full["negative_prompt_embeds"].shape[1] == full["prompt_embeds"].shape[1] == 300
    assert int(full["negative_prompt_attention_mask"].sum()) <= 48
    short = dict(full, negative_prompt_embeds=full["negative_prompt_embeds"][:, :48],
                 negative_prompt_attention_mask=full["negative_prompt_attention_mask"][:, :48])
    ours = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    assert any("300 (positive) and 48 (negative)" in note for note in ours.report.notes)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def run(seed):
        return pipe(**full, negative_prompt=None, num_inference_steps=2, guidance_scale=4.5, width=32, height=32,
                    generator=torch.Generator().manual_seed(seed)).images

    assert max_pixel_difference(ours.images, run(7)) == 0
    assert max_pixel_difference(ours.images, run(8)) > 0


@pytest.mark.slow  # HiDream end to end, several seconds
def test_hidream_unequal_lengths_split_passes(tiny_models, monkeypatch):
    """HiDream batches its guidance passes over two text sequences (T5 [B, L, D], Llama [layers, B, L, D]);
    unequal lengths run as two transformer calls. The padding never reaches the transformer, and with
    equal lengths the split path computes what the pipeline's batched path does."""
    import numpy as np
    import diffusers

    import memfit.models.families.base as families_base
    import memfit.models.families.hidream as hidream

    model = tiny_models("hidream")
    settings = dict(steps=1, guidance=5.0, seed=7, width=32, height=32)  # 4096 image tokens: keep it short
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE)
    full = embeddings.tensors
    assert full["negative_prompt_embeds_t5"].shape[1] == full["negative_prompt_embeds_llama3"].shape[2] == 128
    short = dict(full, negative_prompt_embeds_t5=full["negative_prompt_embeds_t5"][:, :48],
                 negative_prompt_embeds_llama3=full["negative_prompt_embeds_llama3"][:, :, :40])
    first = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    notes = " ".join(first.report.notes)
    assert "prompt_embeds_t5 of lengths 128 (positive) and 48 (negative)" in notes
    assert "prompt_embeds_llama3 of lengths 128 (positive) and 40 (negative)" in notes

    def noisy_pad(tensor, length, dim=1):
        shape = list(tensor.shape)
        shape[dim] = length - tensor.shape[dim]
        return torch.cat([tensor, 100 * torch.randn(shape)], dim=dim) if shape[dim] > 0 else tensor

    with monkeypatch.context() as patch:
        patch.setattr(families_base, "pad_to_length", noisy_pad)  # the padding PipelineAdapter.pad_to_longest does
        second = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **settings)
    assert max_pixel_difference(first.images, second.images) == 0

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def run(output_type):
        return pipe(**full, num_inference_steps=1, guidance_scale=5.0, width=32, height=32,
                    generator=torch.Generator().manual_seed(7), output_type=output_type).images

    whole = memfit.generate(model=model, embeddings=_embeddings(model, full), progress=False, **settings)
    assert max_pixel_difference(run("pil"), whole.images) == 0  # memfit with embeddings equals diffusers
    batched = run("np")
    equal = {"prompt_embeds_t5": (128, 128), "prompt_embeds_llama3": (128, 128)}
    with hidream.split_guidance_passes(pipe.transformer, equal):
        split = run("np")
    assert "forward" not in vars(pipe.transformer)
    np.testing.assert_allclose(split, batched, rtol=0, atol=1e-5)
    with hidream.split_guidance_passes(pipe.transformer, {"prompt_embeds_t5": (48, 128), "prompt_embeds_llama3": (40, 128)}):
        cut = run("np")
    assert np.abs(cut - batched).max() > 1e-5  # the negative pass really saw only its cut embeddings


def _expert_bytes(model):
    return [_weight_bytes(model, [name]) for name in ("transformer", "transformer_2")]


def test_wan22_plans_its_experts_apart(tiny_models):
    """Wan 2.2's experts run one at a time: the plan has a denoise stage per expert, each needing the
    larger expert, so a budget for one expert keeps every weight resident; planned together (the
    adapter without experts) the same budget streams."""
    from memfit.plan.planner import make_plan
    from memfit.plan.stages import choose_strategies, stage_options

    model = tiny_models("wan22")
    adapter = ModelFolder.open(model).adapter
    room = memfit.Budget(device=3 * max(_expert_bytes(model)) // 2, host=0, disk=model)

    def denoise(plan):
        return {stage.name: stage for stage in plan.stages if stage.name.startswith("denoise")}

    options = stage_options(adapter, dtype="fp32", width=32, height=32, steps=2)
    phases = denoise(make_plan(choose_strategies(options, room)[0], room))
    assert list(phases) == ["denoise:transformer", "denoise:transformer_2"]
    assert all(stage.streamed_from_disk_bytes == 0 and len({p.component for p in stage.placements}) == 1
               for stage in phases.values())
    assert max(stage.peak_bytes for stage in phases.values()) < sum(_expert_bytes(model))
    adapter.experts = ()  # both in one stage, as before experts were planned apart
    options = stage_options(adapter, dtype="fp32", width=32, height=32, steps=2)
    together = denoise(make_plan(choose_strategies(options, room)[0], room))
    assert list(together) == ["denoise"] and together["denoise"].streamed_from_disk_bytes > 0


@pytest.mark.parametrize("budget", ["auto", "one-expert", "streams"])
def test_wan22_brings_in_the_second_expert_at_the_boundary(tiny_models, streamed_plans, budget):
    """Wan 2.2's video equals plain diffusers' bit for bit, with no budget, with one for one expert and not
    both, and with less (the experts stream); the second expert is read only after the first was released,
    once the loop reached the boundary; neither the plan nor the process's memory ever holds both experts."""
    model = tiny_models("wan22")
    experts = _expert_bytes(model)
    budget = {"auto": "auto", "one-expert": 3 * max(experts) // 2, "streams": 3 * max(experts) // 4}[budget]
    settings = dict(BASE, guidance=5.0, negative_prompt=NEGATIVE, num_frames=5, steps=4)  # two steps per expert
    assert_matches_diffusers(model, atol=0, budget=budget, **settings)
    result = memfit.generate(model=model, budget=budget, progress=False, **settings)  # measured warm
    phases = {stage.name: stage for stage in streamed_plans[-2].stages}  # the last run's denoise plan
    assert set(phases) == {"denoise:transformer", "denoise:transformer_2"}
    assert all((stage.streamed_from_disk_bytes == 0) == (budget != 3 * max(experts) // 4) for stage in phases.values())

    moves = [move for move in result.timeline.moves if move.stage == "denoise"]
    first = [move for move in moves if move.block.startswith("transformer/")]
    second = [move for move in moves if move.block.startswith("transformer_2/")]
    released = [move.end for move in first if move.to_tier == "disk"]
    assert second and released and all(move.to_tier == "device" for move in second)
    assert max(move.end for move in first) <= min(move.start for move in second)
    assert sum(move.bytes for move in first if move.to_tier == "disk") > max(experts) // 2 or phases[
        "denoise:transformer"].streamed_from_disk_bytes  # all it held resident went back

    denoise = next(stage for stage in result.report.stages if stage.stage == "denoise")
    assert denoise.planned_peak_bytes < sum(experts)
    assert denoise.peak_bytes - denoise.start_bytes < sum(experts), (denoise.peak_bytes - denoise.start_bytes, experts)


def test_wan22_guides_its_second_expert_with_guidance_scale_2(tiny_models):
    """guidance_scale_2 reaches the pipeline as plain diffusers takes it, bit for bit, changes the video, and is
    recorded; a Wan folder with one transformer refuses it."""
    from memfit.errors import MemfitError

    model = tiny_models("wan22")
    settings = dict(BASE, guidance=5.0, negative_prompt=NEGATIVE, num_frames=5)
    ours, _ = assert_matches_diffusers(model, atol=0, guidance_scale_2=2.0, **settings)
    assert ours.settings.guidance_scale_2 == 2.0 and ours.metadata["guidance_scale_2"] == "2.0"
    same = memfit.generate(model=model, progress=False, **settings)
    assert same.settings.guidance_scale_2 is None and max_pixel_difference(ours.frames, same.frames) > 0
    with pytest.raises(MemfitError, match="transformer_2"):
        memfit.generate(model=tiny_models("wan"), guidance_scale_2=2.0, progress=False, **settings)


def test_optional_settings_are_resolved_or_refused(tiny_models):
    """true_cfg_scale and num_frames reach only the pipelines that take them; Wan's defaults are its own."""
    from memfit.errors import MemfitError

    flux = ModelFolder.open(tiny_models("flux")).adapter
    assert flux.resolve(PROMPT, None, 2, None, 0, 32, 32).true_cfg_scale == 1.0
    settings = flux.resolve(PROMPT, NEGATIVE, 2, None, 0, 32, 32, true_cfg_scale=3)
    assert settings.true_cfg_scale == 3.0 and settings.guidance == 3.5 and flux.guided(settings)
    assert not flux.guided(flux.resolve(PROMPT, None, 2, None, 0, 32, 32, true_cfg_scale=3))  # no negative prompt
    with pytest.raises(MemfitError, match="takes no true_cfg_scale"):
        ModelFolder.open(tiny_models("sd3")).adapter.resolve(PROMPT, None, 2, None, 0, 32, 32, true_cfg_scale=3)
    with pytest.raises(MemfitError, match="takes no num_frames"):
        memfit.generate(PROMPT, model=tiny_models("flux"), num_frames=5, progress=False)

    wan = ModelFolder.open(tiny_models("wan")).adapter
    with pytest.raises(MemfitError, match="rope_max_seq_len 32.* reaches at most 512x512 with 125 frames"):
        wan.resolve(PROMPT, None, None, None, 0, None, None)  # the tiny transformer's table is shorter than a real one's
    wan.resolve(PROMPT, None, None, None, 0, None, None, makes_images=False)  # encoding a prompt uses no size
    wan.configs["transformer"]["rope_max_seq_len"] = 1024  # a real Wan's: its pipeline's defaults fit
    settings = wan.resolve(PROMPT, None, None, None, 0, None, None)
    assert (settings.num_frames, settings.width, settings.height, settings.guidance) == (81, 832, 480, 5.0)
    assert wan.latent_frames(settings) == 21
    with pytest.raises(MemfitError, match="use 5 or 9"):
        wan.resolve(PROMPT, None, 2, None, 0, 32, 32, num_frames=6)

    qwen = ModelFolder.open(tiny_models("qwenimage")).adapter
    settings = qwen.resolve(PROMPT, NEGATIVE, None, None, 0, 32, 32)
    assert settings.guidance == 4.0 and qwen.call_kwargs(settings)["true_cfg_scale"] == 4.0


@pytest.mark.parametrize("kind", [*PIPELINE_KINDS, "wan", "hunyuan_video15", "ltx", "ltx2", "sd_pag", "qwenimage_edit", "flux_fill"])
def test_plan_model_works_for_every_family(tiny_models, kind, capsys):
    """memfit plan --model plans every family's folder from its configs, with the family's adapter."""
    from memfit.cli.app import main

    assert main(["plan", "--model", tiny_models(kind), "--budget", "8GiB", "--json"]) == 0  # Wan decodes 81 frames
    report = json.loads(capsys.readouterr().out)
    stages = {stage["name"]: stage for stage in report["plan"]["stages"]}
    assert set(stages) == {"encode", "denoise", "decode"}
    assert all(stage["placements"] for stage in stages.values()), kind


def test_a_class_without_adapter_runs_its_own_call(tiny_models, streamed_plans, tmp_path, monkeypatch):
    """StableDiffusionPAGPipeline has no adapter: memfit runs its __call__ in one stage, equal to plain
    diffusers, also with a budget that streams weights from disk; encode-only is refused plainly."""
    from memfit.errors import MemfitError

    model = tiny_models("sd_pag")
    assert not ModelFolder.open(model).adapter.staged
    settings = dict(BASE, guidance=5.0, negative_prompt=NEGATIVE)
    ours, _ = assert_matches_diffusers(model, atol=0, **settings)
    assert [stage.stage for stage in ours.report.stages] == ["pipeline"]
    assert "own __call__" in ours.report.stages[0].note
    other_seed = diffusers_output(model, dataclasses.replace(ours.settings, seed=8))
    assert max_pixel_difference(ours.images, other_seed) > 0

    budget = _smallest_budget(model, settings)
    assert budget < _weight_bytes(model, ["unet", "text_encoder", "vae"])
    streamed_plans.clear()
    assert_matches_diffusers(model, atol=0, budget=budget, **settings)
    assert streamed_plans[0].stages[0].streamed_from_disk_bytes > 0

    with pytest.raises(MemfitError, match="own __call__, which encodes the prompt itself"):
        memfit.encode(PROMPT, model=model)
