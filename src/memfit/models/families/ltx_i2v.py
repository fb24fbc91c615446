"""LTXImageToVideoPipeline: an LTX-Video folder saved as the image-to-video class, a video from an input image
(--image, its first frame) and a prompt. Every run needs --image: it is the task (img2img), not an option.

Everything is LTX-Video's (memfit.models.families.ltx), whose folders run this pipeline for --image: the T5
encoder, the frame and size rules, the size taken from the image, the VAE's encoder planned in the denoise stage,
the decode.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.models.families.base import IMG2IMG
from memfit.models.families.ltx import LTXAdapter


class LTXImageToVideoAdapter(LTXAdapter):
    class_name = "LTXImageToVideoPipeline"

    def stage_components(self, stage: str) -> tuple[str, ...]:
        # Every run is the image task: what a plan places in the denoise stage is what the run loads there.
        if stage == "denoise":
            return self.task_denoise_components(IMG2IMG)
        return super().stage_components(stage)

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                conditioning=None, makes_images: bool = True, **options):
        if makes_images and (conditioning is None or conditioning.image is None):
            raise MemfitError(f"{self.class_name} makes a video from an image: pass --image IMG (its first frame; "
                              "memfit.generate(..., image=...)).")
        return super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                               conditioning=conditioning, makes_images=makes_images, **options)
