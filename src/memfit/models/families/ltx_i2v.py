"""LTXImageToVideoPipeline: an LTX-Video folder saved as the image-to-video class, a video from an input image
(--image, its first frame) and a prompt. Every run needs --image: it is the task (img2img), not an option.

Everything is LTX-Video's (memfit.models.families.ltx), whose folders run this pipeline for --image: the T5
encoder, the frame and size rules, the size taken from the image, the VAE's encoder planned in the denoise stage,
the decode.
"""

from __future__ import annotations

from memfit.models.families.ltx import LTXAdapter


class LTXImageToVideoAdapter(LTXAdapter):
    class_name = "LTXImageToVideoPipeline"
    needs_image = True
