"""FluxKontextPipeline (FLUX.1 Kontext, image editing): Flux's components, plus an input image (--image).

Everything but the input image is Flux's (memfit.models.families.flux): the same text encoders,
embedded guidance, true CFG, and rule for unequal lengths. The input image is the img2img task: the
pipeline resizes it to the trained Kontext resolution nearest its aspect ratio, encodes it with the
VAE's encoder in its loop set-up (so the encoder is loaded and planned in the denoise stage), and
appends its latents to every transformer call; it takes no --strength. Without an image Kontext
draws from the prompt alone, as FluxPipeline does.

Size: the pipeline rescales the requested width x height to an area of max_area pixels (default
1024 x 1024) at the same aspect ratio. memfit passes max_area = width * height, so the image is the
size asked for (without --width/--height: the input image's size, as for every img2img family).
"""

from __future__ import annotations

from memfit.models.families.base import IMG2IMG
from memfit.models.families.flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    class_name = "FluxKontextPipeline"
    tasks = {IMG2IMG: "FluxKontextPipeline"}

    def context_tokens(self, settings):
        if settings.task != IMG2IMG:
            return super().context_tokens(settings)
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        # The input image's latent patches join every transformer call, at the trained resolution the
        # pipeline resizes it to (which one depends on the image: the largest, about 1024 x 1024, bounds them).
        patch = self.size_multiple()
        return self.max_text_tokens + max((w // patch) * (h // patch) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)

    def call_kwargs(self, settings):
        return dict(super().call_kwargs(settings), max_area=settings.width * settings.height)
