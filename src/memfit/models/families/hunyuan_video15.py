"""HunyuanVideo15Pipeline (HunyuanVideo 1.5), text to video: HunyuanImage 2.1's encoders (a Qwen2.5-VL, and a
ByT5 for the quoted text of a prompt), the HunyuanVideo 1.5 transformer and its 16x (4x in time) video VAE.

What it shares with HunyuanImage (memfit.models.families.hunyuan_image), whose adapter this one extends:
- encoding: the pipeline's own encode_prompt gives the Qwen2.5-VL embeddings and mask and the ByT5 glyph
  embeddings and mask (zero without quoted text), padded to 1000 and 256 tokens;
- guidance is a component, `guider` (a ClassifierFreeGuidance), not a __call__ argument: memfit's guidance is its
  guidance_scale, the folder's own by default, rebuilt at --guidance's for the run (call_components); a guider at
  scale 1 (or disabled) runs no negative pass and needs no negative prompt;
- unequal lengths are native: the guider runs the two passes as separate transformer calls, each with its masks.

The output is a video: memfit's `images` are its frames (PIL), as `HunyuanVideo15Pipeline(...).frames[0]` with
output_type="pil". `num_frames` (Settings field, default: the pipeline's 121) must be 4k+1 and each side a
multiple of the VAE's 16 pixels (times the transformer's patch), which the pipeline would otherwise round down
silently; memfit refuses other counts and sizes. Without --width/--height the video has the pipeline's default
size: the 16:9 bucket of the transformer's target_size (848 x 480 for the 480p models).

The pipeline's __init__ reads the VAE's config without checking it was loaded, so the encode and denoise stages
build it with a weightless stand-in of that config (read_at_init). Its text-to-video loop hands the transformer
729 image-token slots of zeros beside the text (the image-to-video model's SigLIP tokens): context_tokens counts them.
The decode is plain diffusers' too: the VAE decodes every frame at once (no tiling), and the plan's estimate counts
the whole video at full resolution (memfit.plan.meta.WHOLE_VIDEO_DECODERS).

Image to video (the i2v folders, HunyuanVideo15ImageToVideoPipeline) is memfit.models.families.hunyuan_video15_i2v's.
"""

from __future__ import annotations

from memfit.models.families.base import check_frame_count
from memfit.models.families.hunyuan_image import HunyuanImageAdapter

# The image-token slots the transformer always takes (the pipeline's vision_num_semantic_tokens).
IMAGE_TOKENS = 729


class HunyuanVideo15Adapter(HunyuanImageAdapter):
    class_name = "HunyuanVideo15Pipeline"
    denoise_components = ("transformer", "scheduler", "guider")
    read_at_init = ("vae",)
    max_text_tokens = 1000 + 256  # the Qwen2.5-VL tokens and the ByT5 glyph tokens, side by side
    options = ("num_frames",)
    frames_per_second = 24  # its default 121 frames are about 5 seconds (diffusers' i2v example writes 24 fps)
    per_prompt_keyword = "num_videos_per_prompt"

    def vae_scale_factor(self) -> int:
        return int(self.configs["vae"].get("spatial_compression_ratio", 16))

    def temporal_scale_factor(self) -> int:
        return int(self.configs["vae"].get("temporal_compression_ratio", 4))

    def size_multiple(self) -> int:
        # prepare_latents takes height // 16 latent rows, and the transformer patches them: a side that is not a
        # multiple of both would come out smaller than asked.
        return self.vae_scale_factor() * int(self.configs.get("transformer", {}).get("patch_size", 1))

    def default_size(self) -> int:
        return self._default_height_width()[0]  # not square: resolve() takes the pipeline's width and height

    def _default_height_width(self) -> tuple[int, int]:
        """(height, width) of a __call__ without them: the pipeline's 16:9 bucket at the transformer's target_size."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        target_size = self.configs.get("transformer", {}).get("target_size", 640)
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor())
        return processor.calculate_default_height_width(9, 16, target_size)  # as __call__: (height 9, width 16)

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                makes_images: bool = True, **options):
        defaults = defaults or {}
        default_height, default_width = self._default_height_width()
        width = width if width is not None else defaults.get("width", default_width)
        height = height if height is not None else defaults.get("height", default_height)
        settings = super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                                   makes_images=makes_images, **options)
        check_frame_count(settings.num_frames, self.temporal_scale_factor(), self.class_name)
        return settings

    def latent_frames(self, settings) -> int:
        return (settings.num_frames - 1) // self.temporal_scale_factor() + 1

    def context_tokens(self, settings) -> int:
        return self.max_text_tokens + IMAGE_TOKENS

    def call_kwargs(self, settings):
        return dict(super().call_kwargs(settings), num_frames=settings.num_frames)

    def decode(self, pipe, latents, settings, generator):
        # Copied from HunyuanVideo15Pipeline.__call__ after its denoising loop (output_type="pil"); the video's frames.
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = pipe.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype) / vae.config.scaling_factor
        video = vae.decode(latents, return_dict=False)[0]
        return list(pipe.video_processor.postprocess_video(video, output_type="pil")[0])
