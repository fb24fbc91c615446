"""FluxFillPipeline (FLUX.1 Fill: inpainting and outpainting): Flux's components, with an input image (--image)
and a mask (--mask, white where it repaints) on every run.

The text side is Flux's (memfit.models.families.flux): the same CLIP-L and T5 encoders, the same encode.
Guidance is embedded only (FLUX.1 Fill dev is guidance-distilled, its __call__'s default 30): the pipeline takes
no negative prompt and runs no negative pass, so memfit refuses --negative-prompt, and embeddings hold the
positive prompt alone.

The image and the mask are the inpaint task, always (needs_image): in the loop set-up the pipeline noises the
image's latents by --strength (default 1.0: pure noise), and the VAE's encoder turns the image with the masked part
blacked out into latents; those latents and the mask, folded into the latent grid, join the noisy latents along
the channel axis of every transformer call (the transformer's input is 384 channels wide: 64 noisy, 64 masked
image, 256 mask). So the VAE's encoder is loaded and planned in the denoise stage; the transformer sees no more
tokens than Flux's.

Size: the pipeline resizes the image and the mask to the width and height asked for (without --width/--height:
the image's size rounded down to a multiple of 16). Latents are packed as Flux's; the decode is Flux's.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.models.families.base import INPAINT
from memfit.models.families.flux import FluxAdapter


class FluxFillAdapter(FluxAdapter):
    class_name = "FluxFillPipeline"
    tasks = {INPAINT: "FluxFillPipeline"}
    needs_image = True
    options = ()  # no true_cfg_scale: the pipeline runs no negative pass
    guidance_batch = 1
    unequal_lengths = "none arise: FLUX.1 Fill runs no negative pass (its guidance is embedded)"

    def guided(self, settings) -> bool:
        return False  # guidance-distilled: the guidance scale is embedded, no negative pass

    def resolve(self, prompt, negative_prompt, *args, **kwargs):
        if negative_prompt:
            raise MemfitError(f"{self.class_name} takes no negative prompt: FLUX.1 Fill is guidance-distilled and "
                              "runs no negative pass; leave --negative-prompt out.")
        return super().resolve(prompt, negative_prompt, *args, **kwargs)

    def encode(self, pipe, settings, with_negative):
        return super().encode(pipe, settings, with_negative=False)  # there is no negative pass to encode for
