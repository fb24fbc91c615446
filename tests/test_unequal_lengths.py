"""Positive and negative prompt embeddings of different lengths are never an error.

Per pipeline (see each adapter's `unequal_lengths`):
- CogView4: native separate passes; plain diffusers is its own oracle, bitwise.
- Lumina2: pad with masked zeros; equal, bitwise, to the pipeline given the same negative at full
  length, because positions past the mask are never attended to.
- SD / SDXL: split guidance passes; the split path equals the pipeline's batched path when the
  lengths are equal, and the padding it adds is provably cut off (its content cannot matter).
"""

import numpy as np
import pytest
import torch

import memfit
from memfit.run.embeddings import Embeddings
from memfit.models.folder import ModelFolder
from memfit.models.families.stable_diffusion import split_guidance_passes
from memfit.testing import max_pixel_difference

SETTINGS = dict(steps=2, guidance=4.0, seed=3, width=32, height=32)


def _embeddings(model_dir, tensors, prompt="a red circle"):
    folder = ModelFolder.open(model_dir)
    return Embeddings(tensors, folder.class_name, folder.text_fingerprint, prompt, "blurry")


def _plain(model_dir, **call_kwargs):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        num_inference_steps=SETTINGS["steps"], guidance_scale=SETTINGS["guidance"], width=32, height=32,
        generator=torch.Generator().manual_seed(SETTINGS["seed"]), **call_kwargs,
    ).images[0]


def test_cogview4_144_vs_48_regression(tiny_models):
    """The field report: CogView4 embeddings [1,144,D] and [1,48,D] failed in staged execution."""
    model = tiny_models("cogview4")
    width = ModelFolder.open(model).configs["text_encoder"]["hidden_size"]
    generator = torch.Generator().manual_seed(0)
    positive = torch.randn(1, 144, width, generator=generator)
    negative = torch.randn(1, 48, width, generator=generator)
    ours = memfit.generate(model=model, embeddings=_embeddings(model, {"prompt_embeds": positive, "negative_prompt_embeds": negative}), progress=False, **SETTINGS)
    assert any("144 (positive) and 48 (negative)" in note for note in ours.report.notes)
    reference = _plain(model, prompt_embeds=positive, negative_prompt_embeds=negative)
    assert max_pixel_difference(ours.images[0], reference) == 0


def test_lumina2_masked_padding_equals_full_length(tiny_models):
    model = tiny_models("lumina2")
    embeddings, _ = memfit.encode("a red circle on a blue background", model=model, negative_prompt="blurry")
    full = embeddings.tensors
    assert full["negative_prompt_embeds"].shape[1] > 48
    valid = int(full["negative_prompt_attention_mask"].sum())
    assert valid <= 48, "the negative prompt must fit in 48 tokens for this construction"
    short = dict(full)
    short["negative_prompt_embeds"] = full["negative_prompt_embeds"][:, :48]
    short["negative_prompt_attention_mask"] = full["negative_prompt_attention_mask"][:, :48]
    ours = memfit.generate(model=model, embeddings=_embeddings(model, short), progress=False, **SETTINGS)
    reference = _plain(model, **full)
    assert max_pixel_difference(ours.images[0], reference) == 0


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_split_passes_equal_batched_pipeline(tiny_models, kind):
    """With equal lengths the split path computes exactly what the pipeline's batched path does."""
    import diffusers

    model = tiny_models(kind)
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe("a red circle", negative_prompt="blurry", num_inference_steps=2, guidance_scale=4.0, width=32,
                    height=32, generator=torch.Generator().manual_seed(3), output_type="np").images[0]

    batched = run()
    length = pipe.tokenizer.model_max_length
    with split_guidance_passes(pipe.unet, length, length):
        split = run()
    assert "forward" not in vars(pipe.unet), "the UNet must be restored after the split"
    np.testing.assert_allclose(split, batched, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_split_passes_take_unequal_lengths_and_ignore_padding(tiny_models, kind, monkeypatch):
    model = tiny_models(kind)
    embeddings, _ = memfit.encode("a red circle", model=model, negative_prompt="blurry")
    tensors = dict(embeddings.tensors)
    tensors["negative_prompt_embeds"] = tensors["negative_prompt_embeds"][:, :48]
    assert tensors["prompt_embeds"].shape[1] == 77
    first = memfit.generate(model=model, embeddings=_embeddings(model, tensors), progress=False, **SETTINGS)
    assert any("77 (positive) and 48 (negative)" in note for note in first.report.notes)

    # Pad with noise instead of zeros: if any padded position reached the UNet, the image would change.
    import memfit.models.families.base as families_base

    def noisy_pad(tensor, length, dim=1):
        shape = list(tensor.shape)
        shape[dim] = length - tensor.shape[dim]
        return torch.cat([tensor, 100 * torch.randn(shape)], dim=dim) if shape[dim] > 0 else tensor

    monkeypatch.setattr(families_base, "pad_to_length", noisy_pad)
    second = memfit.generate(model=model, embeddings=_embeddings(model, tensors), progress=False, **SETTINGS)
    assert max_pixel_difference(first.images[0], second.images[0]) == 0
