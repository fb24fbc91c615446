"""StableDiffusionXLImg2ImgPipeline as the SDXL *refiner*: it finishes a base model's latents.

memfit runs it only after a base model (memfit.run.refiner; CLI `--refiner`), the way diffusers
documents the ensemble of expert denoisers: the base stops at ``denoising_end=refiner_start`` and
hands over latents (``output_type="latent"``); the refiner continues from
``denoising_start=refiner_start`` on those latents (no noise added, no VAE encode), then one VAE
decode. The refiner usually has only the second text encoder (text_encoder=None), which
``encode_prompt`` handles; its CFG rule is SD's (one batched UNet call, split into two passes when
the embeddings have different lengths).
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError
from memfit.models.families.stable_diffusion import StableDiffusionXLAdapter


class _ConfigOnly:
    """A weightless stand-in for a component of which a pipeline reads only the config."""

    def __init__(self, config):
        self.config = config


class StableDiffusionXLImg2ImgAdapter(StableDiffusionXLAdapter):
    class_name = "StableDiffusionXLImg2ImgPipeline"
    tasks = {}  # runs only as a refiner (memfit.run.refiner), which takes no --image, --mask or --lora yet
    takes_lora = False
    # Components missing from a refiner folder (text_encoder, tokenizer) are skipped by the runner.

    def resolve(self, *args, **kwargs):
        raise MemfitError(
            "This is an SDXL refiner (StableDiffusionXLImg2ImgPipeline): it refines a base model's latents "
            "and cannot start from a prompt alone; run it after a base model: "
            "memfit generate --model BASE --refiner REFINER (or memfit.generate(..., refiner=REFINER))."
        )

    def refine(self, pipe, embeddings: dict[str, torch.Tensor], settings, latents: torch.Tensor,
               denoising_start: float, generator, split: bool = False) -> torch.Tensor:
        """Continue the base's latents from `denoising_start`; returns the final latents.

        split: run the two guidance passes one after the other; this is PipelineAdapter.denoise on
        the img2img pipeline, so its rules for split and unequal lengths are SD's.
        """
        if pipe.vae is None:
            # The denoise stage loads no VAE, but prepare_latents reads vae.config (latents mean and
            # std) even for latent input; the config from the folder is all it needs.
            from diffusers.configuration_utils import FrozenDict

            pipe.vae = _ConfigOnly(FrozenDict(self.configs["vae"]))
        # The base's latents are the img2img pipeline's image: no noise added, no VAE encode.
        return self.denoise(pipe, embeddings, settings, generator, split=split,
                            inputs=dict(image=latents, denoising_start=denoising_start))

    def call_kwargs(self, settings):
        # The pipeline draws at the size of its image (the base's latents): it takes no width or height.
        return dict(num_inference_steps=settings.steps, guidance_scale=settings.guidance)

    # decode: StableDiffusionXLImg2ImgPipeline.__call__'s post-loop code is the same as
    # StableDiffusionXLPipeline's (upcast, latents mean/std, vae.decode, watermark, postprocess).
