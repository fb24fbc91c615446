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

Size (without --width/--height) and the ftfy check: as Wan 2.2 TI2V-5B's image path (memfit.models.families.wan).
"""

from __future__ import annotations

from memfit.models.families.base import IMG2IMG
from memfit.models.families.wan import WanAdapter, check_prompt_cleaning


class WanImageToVideoAdapter(WanAdapter):
    class_name = "WanImageToVideoPipeline"
    tasks = {IMG2IMG: "WanImageToVideoPipeline"}
    needs_image = True
    # The image encoder (Wan 2.1 only) runs in the pipeline's loop set-up; task_denoise_components adds the VAE.
    denoise_components = ("transformer", "transformer_2", "scheduler", "image_encoder", "image_processor")

    def takes_image(self) -> bool:
        return True

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                conditioning=None, makes_images: bool = True, **options):
        check_prompt_cleaning()  # its encode_prompt cleans the prompt too, with or without an image
        return super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                               conditioning=conditioning, makes_images=makes_images, **options)

    def context_tokens(self, settings):
        # Wan 2.1's transformer attends to the CLIP image encoder's tokens (its patches and class token) beside the
        # prompt's; Wan 2.2 I2V's has no image tokens.
        encoder = self.configs.get("image_encoder")
        if encoder is None:
            return super().context_tokens(settings)
        vision = encoder.get("vision_config", encoder)
        return self.max_text_tokens + (vision.get("image_size", 224) // vision.get("patch_size", 14)) ** 2 + 1
