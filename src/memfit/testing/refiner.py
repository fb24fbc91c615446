"""A tiny SDXL base + refiner pair, built from configs with a fixed seed: no hub, no downloads.

The refiner is what diffusers ships as stabilityai/stable-diffusion-xl-refiner-1.0, shrunk: a
StableDiffusionXLImg2ImgPipeline with no first text encoder (text_encoder=None, tokenizer=None),
requires_aesthetics_score=True (five time ids: original size, crop, aesthetic score), and a UNet
whose cross-attention width is the second text encoder's and whose added-condition projection
fits the pooled text embedding plus five time ids. Like the real pair, the refiner *shares* the
base's VAE and second text encoder: `save_base_and_refiner` saves the very same module objects
into both folders, so the two folders hold byte-identical weights for them (same content
fingerprint), which is what lets memfit load, compile and cache a shared component once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.testing.pipelines import build_pipeline, sdxl_unet
from memfit.testing.tokenizers import clip_tokenizer

# How many time ids the refiner's UNet sees: original (h, w), crop (top, left), aesthetic score.
_REFINER_TIME_IDS = 5


def build_refiner(base, *, seed: int = 1, scale: int = 1):
    """A tiny SDXL refiner sharing `base`'s VAE and text_encoder_2 objects (and a copy of its
    tokenizer_2 and scheduler config), in eval mode, progress bar off."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline

    text_encoder_2 = base.text_encoder_2
    torch.manual_seed(seed)
    unet = sdxl_unet(
        scale,
        pooled_dim=text_encoder_2.config.projection_dim,
        time_ids=_REFINER_TIME_IDS,
        cross_attention_dim=text_encoder_2.config.hidden_size,  # the refiner sees text_encoder_2's hidden states only
    ).eval()
    refiner = StableDiffusionXLImg2ImgPipeline(
        vae=base.vae,
        text_encoder=None,
        text_encoder_2=text_encoder_2,
        tokenizer=None,
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=EulerDiscreteScheduler.from_config(base.scheduler.config),
        requires_aesthetics_score=True,
        force_zeros_for_empty_prompt=True,
    )
    refiner.set_progress_bar_config(disable=True)
    return refiner


def build_base_and_refiner(*, seed: int = 0, scale: int = 1, text_layers: int = 2, kind: str = "sdxl"):
    """(base, refiner): a tiny StableDiffusionXLPipeline (of ``kind``: "sdxl_single_file" for a pair that can
    be written as single files) and a refiner sharing its VAE and second text encoder objects."""
    base = build_pipeline(kind, seed=seed, scale=scale, text_layers=text_layers)
    return base, build_refiner(base, seed=seed + 1, scale=scale)


def save_base_and_refiner(base_path: str | Path, refiner_path: str | Path, *, seed: int = 0, scale: int = 1,
                          text_layers: int = 2, kind: str = "sdxl") -> tuple[Path, Path]:
    """Build the pair (build_base_and_refiner) and save both in the diffusers layout (safetensors); the shared
    VAE and text_encoder_2 are saved from the same objects, so both folders hold identical files."""
    base, refiner = build_base_and_refiner(seed=seed, scale=scale, text_layers=text_layers, kind=kind)
    base_path, refiner_path = Path(base_path), Path(refiner_path)
    base.save_pretrained(base_path, safe_serialization=True)
    refiner.save_pretrained(refiner_path, safe_serialization=True)
    return base_path, refiner_path


def diffusers_refined_image(base_dir: str | Path, refiner_dir: str | Path, *, prompt: str, negative_prompt=None,
                            steps: int, guidance: float, seed: int, width: int, height: int,
                            refiner_start: float = 0.8, dtype: torch.dtype = torch.float32,
                            refiner_file: str | Path | None = None):
    """The image plain diffusers makes with its documented base + refiner workflow: the refiner
    loaded with the base's text_encoder_2 and vae objects, the base stopping at
    denoising_end=refiner_start with latent output, the refiner continuing from
    denoising_start=refiner_start; one seeded CPU generator through both calls. With ``refiner_file``
    the refiner's UNet is diffusers' single-file loading of that checkpoint (configs from ``refiner_dir``)."""
    import diffusers

    from memfit.models.folder import dtype_keyword

    dtype_kwarg = {dtype_keyword(): dtype}  # diffusers 0.42 renamed torch_dtype to dtype
    base = diffusers.StableDiffusionXLPipeline.from_pretrained(base_dir, **dtype_kwarg)
    shared = dict(text_encoder_2=base.text_encoder_2, vae=base.vae, **dtype_kwarg)
    if refiner_file is None:
        refiner = diffusers.StableDiffusionXLImg2ImgPipeline.from_pretrained(refiner_dir, **shared)
    else:
        refiner = diffusers.StableDiffusionXLImg2ImgPipeline.from_single_file(
            str(refiner_file), config=str(refiner_dir), local_files_only=True, **shared)
    for pipe in (base, refiner):
        pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    common = dict(prompt=prompt, negative_prompt=negative_prompt, num_inference_steps=steps, guidance_scale=guidance,
                  generator=generator)
    latents = base(**common, width=width, height=height, denoising_end=refiner_start, output_type="latent").images
    return refiner(**common, denoising_start=refiner_start, image=latents).images[0]
