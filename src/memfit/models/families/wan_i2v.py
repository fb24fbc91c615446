"""WanImageToVideoPipeline: Wan 2.1 I2V and Wan 2.2 I2V A14B, a video from an input image (--image) and a prompt.

Everything but the input image is Wan text-to-video's (memfit.models.families.wan): the UMT5 text encoder,
the separate guidance passes, the frame count rule, the rotary table check, Wan 2.2's two experts switched at
boundary_ratio with --guidance-2, the decode. Every run needs --image: it is the task (img2img), not an option.

The input image reaches the transformers in the pipeline's loop set-up, so what encodes it is loaded and planned
in the denoise stage, as FLUX.1 Kontext's VAE encoder is:
- the VAE's encoder turns the image (the video's first frame, the other frames zeros) into condition latents once;
  they join the noise, with a first-frame mask, in every transformer call;
- Wan 2.1 I2V also has a CLIP image encoder (image_encoder, with its image_processor); its second-to-last hidden
  layer's tokens join the prompt's in every call. Wan 2.2 I2V has none (image_encoder null in model_index.json).
Wan 2.2's experts are planned apart as in text-to-video; the VAE's encoder and the image encoder run before
the first expert and are planned beside each.

Size: without --width/--height, the image's aspect ratio at the area of the pipeline's default 832 x 480 (or of
memfit_defaults.json's width x height), each side rounded down to the transformer's patch in pixels, as
diffusers' WanImageToVideoPipeline example computes it; the pipeline resizes the image to that size.

The pipeline cleans prompts with ftfy, which this diffusers module uses without checking that it is installed
(WanPipeline skips it when it is not): memfit refuses the run before anything loads when ftfy is missing.
"""

from __future__ import annotations

import math

from memfit.errors import MemfitError
from memfit.models.families.base import IMG2IMG
from memfit.models.families.wan import WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    class_name = "WanImageToVideoPipeline"
    tasks = {IMG2IMG: "WanImageToVideoPipeline"}
    # The image encoder (Wan 2.1 only) runs in the pipeline's loop set-up; task_denoise_components adds the VAE.
    denoise_components = ("transformer", "transformer_2", "scheduler", "image_encoder", "image_processor")

    def stage_components(self, stage: str) -> tuple[str, ...]:
        # Every run is the image task: what a plan places in the denoise stage is what the run loads there.
        if stage == "denoise":
            return self.task_denoise_components(IMG2IMG)
        return super().stage_components(stage)

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                conditioning=None, makes_images: bool = True, **options):
        image = None if conditioning is None else conditioning.image
        if makes_images and image is None:
            raise MemfitError(f"{self.class_name} makes a video from an image: pass --image IMG (its first frame; "
                              "memfit.generate(..., image=...)).")
        _check_prompt_cleaning()
        if image is not None and (width is None or height is None):
            sized_width, sized_height = self.size_for(image, defaults or {})
            width = sized_width if width is None else width
            height = sized_height if height is None else height
        return super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                               conditioning=conditioning, makes_images=makes_images, **options)

    def size_for(self, image, defaults: dict) -> tuple[int, int]:
        """(width, height) for ``image`` without --width/--height: its aspect ratio at the default area."""
        call_defaults = self.call_defaults()
        area = defaults.get("width", call_defaults["width"]) * defaults.get("height", call_defaults["height"])
        patch = self.configs.get("transformer", self.configs.get("transformer_2", {})).get("patch_size", (1, 2, 2))
        step = self.vae_scale_factor() * patch[1]
        aspect = image.height / image.width
        height = max(step, round(math.sqrt(area * aspect)) // step * step)
        width = max(step, round(math.sqrt(area / aspect)) // step * step)
        return width, height

    def context_tokens(self, settings):
        # Wan 2.1's transformer attends to the CLIP image encoder's tokens (its patches and class token) beside the
        # prompt's; Wan 2.2 I2V's has no image tokens.
        encoder = self.configs.get("image_encoder")
        if encoder is None:
            return super().context_tokens(settings)
        vision = encoder.get("vision_config", encoder)
        return self.max_text_tokens + (vision.get("image_size", 224) // vision.get("patch_size", 14)) ** 2 + 1


def _check_prompt_cleaning() -> None:
    """Refuse a run WanImageToVideoPipeline would fail in its first step for want of ftfy (a NameError)."""
    from diffusers.pipelines.wan import pipeline_wan_i2v

    if getattr(pipeline_wan_i2v, "ftfy", None) is None:
        raise MemfitError("WanImageToVideoPipeline cleans prompts with the ftfy package, which is not installed; "
                          "install it (pip install ftfy) and run again.")
