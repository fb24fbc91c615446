"""Flux2Pipeline (FLUX.2 dev: Mistral-Small-3 text encoder) and Flux2KleinPipeline (FLUX.2 klein: Qwen3).

Both share the Flux2 transformer and the AutoencoderKLFlux2 VAE; they differ in the text encoder and guidance.

Text: encode_prompt stacks three of the text encoder's hidden layers into one [1, 512, 3 x width]
embedding (the tokenizer always pads to 512 tokens) and derives the text ids from its length, so
only the embedding is kept; the pipeline derives the ids again from a passed embedding.

Guidance:
- FLUX.2 dev is guidance-distilled: `guidance` is embedded in every transformer call and there is no
  negative pass, so it takes no negative prompt (refused rather than ignored).
- FLUX.2 klein runs true classifier-free guidance as a second, separate transformer pass when
  guidance > 1, unless the model is step-distilled (``is_distilled`` in model_index.json: then the
  pipeline ignores guidance). Its __call__ takes no negative prompt, only negative_prompt_embeds,
  and encodes "" without them; memfit encodes the negative prompt (or "") with the same encode_prompt
  call and passes it as negative_prompt_embeds. Unequal lengths are native: each pass gets its own
  embedding and text ids.

Reference images (--image): both pipelines take them as the img2img task, as FLUX.1 Kontext does: the
VAE's encoder turns the image into latents in the loop set-up (so the VAE is loaded in the denoise
stage), and its tokens join every transformer call; there is no --strength. The output takes the
image's size unless --width/--height say otherwise.

Latents: the transformer sees a sequence of 2x2-patchified latents with 4-D position ids. The denoise
stage hands over the patchified latents in the VAE's spatial layout (the pipeline's
_unpack_latents_with_ids, first step of its post-loop code); decode copies the rest: the VAE's
batch-norm statistics, unpatchify, decode. Flux2Pipeline with output_type="latent" stops before that
first step; Flux2KleinPipeline runs its whole post-loop code even then (it reads the VAE's
batch-norm in the denoise stage, where the VAE is not loaded), so memfit ends its call at that step.
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError
from memfit.models.families.base import IMG2IMG, PipelineAdapter, paired_embeddings

# Flux2Pipeline and Flux2KleinPipeline scale a reference image above this area down to it (their __call__).
REFERENCE_MAX_AREA = 1024 * 1024


class _LoopDone(Exception):
    """Raised from inside Flux2KleinPipeline.__call__ at its first post-loop step, carrying the packed latents."""

    def __init__(self, latents: torch.Tensor):
        super().__init__("denoising loop done")
        self.latents = latents


class Flux2Adapter(PipelineAdapter):
    class_name = "Flux2Pipeline"
    takes_lora = True  # into the transformer, the only LoRA-loadable module of both FLUX.2 pipelines
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "none arise: FLUX.2 dev runs no negative pass (its guidance is embedded)"
    max_text_tokens = 512
    guidance_batch = 1
    tasks = {IMG2IMG: "Flux2Pipeline"}
    takes_negative_prompt = False  # dev runs no negative pass; klein's second guidance pass takes one

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * 2  # latents are patchified 2x2

    def default_size(self) -> int:
        return 128 * self.vae_scale_factor()  # the pipelines' default_sample_size

    def guided(self, settings) -> bool:
        return False  # guidance-distilled: the guidance scale is embedded, no negative pass

    def resolve(self, prompt, negative_prompt, *args, conditioning=None, **kwargs):
        """PipelineAdapter.resolve, refusing a negative prompt dev has no pass for and a reference image the
        pipeline's image processor would refuse."""
        if negative_prompt and not self.takes_negative_prompt:
            raise MemfitError(f"{self.class_name} takes no negative prompt: FLUX.2 dev is guidance-distilled and "
                              "runs no negative pass; leave --negative-prompt out.")
        if conditioning is not None and conditioning.image is not None:
            from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

            try:
                Flux2ImageProcessor.check_image_input(conditioning.image)
            except ValueError as exc:
                raise MemfitError(f"{self.class_name} cannot take this --image: {exc}; "
                                  "give a larger image or one closer to square.") from None
        return super().resolve(prompt, negative_prompt, *args, conditioning=conditioning, **kwargs)

    def context_tokens(self, settings):
        if settings.task != IMG2IMG:
            return super().context_tokens(settings)
        # The reference image's latent patches join every transformer call, at most REFERENCE_MAX_AREA pixels of them.
        return self.max_text_tokens + REFERENCE_MAX_AREA // self.size_multiple() ** 2

    def encode(self, pipe, settings, with_negative):
        embeddings, _ = pipe.encode_prompt(prompt=settings.prompt, device=pipe._execution_device,
                                           num_images_per_prompt=1)
        return {"prompt_embeds": embeddings}

    def after_loop(self, pipe, latents, settings):
        # As the pipeline's post-loop code does first: scatter the packed sequence back into the latent grid
        # by its position ids (prepare_latents' ids for this size; only their shape matters here).
        side = pipe.vae_scale_factor * 2
        grid = torch.empty((latents.shape[0], 1, settings.height // side, settings.width // side), device="meta")
        latent_ids = pipe._prepare_latent_ids(grid).to(latents.device)
        return pipe._unpack_latents_with_ids(latents, latent_ids)

    def decode(self, pipe, latents, settings, generator):
        # Copied from Flux2Pipeline.__call__ after its denoising loop (_unpack_latents_with_ids ran in denoise).
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = pipe.vae
        latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        latents = latents * latents_bn_std + latents_bn_mean
        latents = pipe._unpatchify_latents(latents)
        latents = latents.to(get_module_execution_device(vae))
        image = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")


class Flux2KleinAdapter(Flux2Adapter):
    class_name = "Flux2KleinPipeline"
    tasks = {IMG2IMG: "Flux2KleinPipeline"}
    unequal_lengths = "native: the two guidance passes are separate transformer calls, each with its own text ids"
    separate_guidance_passes = True
    takes_negative_prompt = True

    @property
    def distilled(self) -> bool:
        """Whether the model is step-distilled (model_index.json's is_distilled): its pipeline then ignores guidance."""
        return bool(self.pipeline_options.get("is_distilled", False))

    def guided(self, settings) -> bool:
        return settings.guidance > 1 and not self.distilled  # Flux2KleinPipeline.do_classifier_free_guidance

    def encode(self, pipe, settings, with_negative):
        device = pipe._execution_device
        positive, _ = pipe.encode_prompt(prompt=settings.prompt, device=device, num_images_per_prompt=1)
        negative = None
        if with_negative:
            # The pipeline's own negative is "" (encoded with this same call); a negative prompt replaces it.
            negative, _ = pipe.encode_prompt(prompt=settings.negative_prompt or "", device=device,
                                             num_images_per_prompt=1)
        return paired_embeddings(with_negative, prompt_embeds=(positive, negative))

    def denoise_call(self, pipe, embeddings, settings, generator, **inputs):
        def stop_after_loop(latents, latent_ids, *args, **kwargs):
            raise _LoopDone(latents)

        pipe._unpack_latents_with_ids = stop_after_loop
        try:
            super().denoise_call(pipe, embeddings, settings, generator, **inputs)
        except _LoopDone as done:
            return done.latents
        finally:
            del pipe._unpack_latents_with_ids
        raise MemfitError(f"{self.class_name}.__call__ returned without unpacking its latents; this diffusers "
                          "version is not one memfit's FLUX.2 klein adapter knows.")
