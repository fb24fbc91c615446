"""LTX2ImageToVideoPipeline: an LTX-2 folder saved as the image-to-video class, a video with audio from an input image
(--image, its first frame) and a prompt. Every run needs --image: it is the task (img2img), not an option.

Everything is LTX-2's (memfit.models.families.ltx2), whose folders run this pipeline for --image: the Gemma-3
encoder, the frame and size rules, the size taken from the image, the VAE's encoder planned in the denoise stage
(the pipeline re-compresses the image as H.264 at the CRF its text encoder's generation was trained with, then
encodes it as the first latent frame, kept at timestep 0), the decode and the soundtrack.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.models.families.base import IMG2IMG
from memfit.models.families.ltx2 import LTX2Adapter


class LTX2ImageToVideoAdapter(LTX2Adapter):
    class_name = "LTX2ImageToVideoPipeline"

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
