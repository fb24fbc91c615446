"""What the pipelines that pack their latents in 2x2 patches share: FluxPipeline, ChromaPipeline
and QwenImagePipeline.

Their transformers see the latents as a sequence of 2x2 patches, so an image side is a multiple
of twice the VAE's scale. Their __call__ with output_type="latent" returns that packed sequence,
and the first step of their post-loop code unpacks it into the VAE's layout (the pipeline's
_unpack_latents, which needs the image size). memfit runs that step at the end of the denoise
stage (after_loop), so the latents handed over are in the VAE's layout ([B, C, H/8, W/8], QwenImage's
[B, C, 1, H/8, W/8]) and each family's decode copies the rest of its pipeline's post-loop code.
"""

from __future__ import annotations

from memfit.models.families.base import PipelineAdapter


class PackedLatentsAdapter(PipelineAdapter):
    """Base class of the adapters of pipelines with packed latents (see the module doc)."""

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * 2  # latents are packed in 2x2 patches

    def default_size(self) -> int:
        return 128 * self.vae_scale_factor()  # the pipelines' default_sample_size

    def after_loop(self, pipe, latents, settings):
        # As the pipeline's __call__ does first after its loop: unpack into the VAE's layout.
        return pipe._unpack_latents(latents, settings.height, settings.width, pipe.vae_scale_factor)
