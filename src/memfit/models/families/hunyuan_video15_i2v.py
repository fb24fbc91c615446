"""HunyuanVideo15ImageToVideoPipeline: HunyuanVideo 1.5 i2v, a video from an input image (--image, its first frame)
and a prompt. Every run needs --image: it is the task (img2img), not an option.

Everything but the input image is HunyuanVideo 1.5 text-to-video's (memfit.models.families.hunyuan_video15): the
Qwen2.5-VL and ByT5 encoders, guidance held by the guider, the frame count rule, the decode.

The input image reaches the transformer in the pipeline's loop set-up, so what encodes it is loaded and planned in
the denoise stage, as Wan I2V's is: the VAE's encoder turns it into the first latent frame of the condition latents
(with a first-frame mask), and the SigLIP image encoder (image_encoder, with its feature_extractor) into the image
tokens the transformer attends to beside the prompt's.

Size: the pipeline takes no width or height; it draws at the aspect-ratio bucket of the image at the transformer's
target_size (the image resized and cropped to it). memfit takes that size, and refuses a --width/--height that
differs from it.
"""

from __future__ import annotations

from memfit.models.families.base import IMG2IMG
from memfit.models.families.hunyuan_video15 import HunyuanVideo15Adapter


class HunyuanVideo15ImageToVideoAdapter(HunyuanVideo15Adapter):
    class_name = "HunyuanVideo15ImageToVideoPipeline"
    tasks = {IMG2IMG: "HunyuanVideo15ImageToVideoPipeline"}
    needs_image = True
    # The image encoder runs in the pipeline's loop set-up; task_denoise_components adds the VAE.
    denoise_components = ("transformer", "scheduler", "guider", "image_encoder", "feature_extractor")

    def drawn_size(self, image, task):
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        target_size = self.configs.get("transformer", {}).get("target_size", 640)
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor())
        height, width = processor.calculate_default_height_width(image.height, image.width, target_size)
        return width, height

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                conditioning=None, makes_images: bool = True, **options):
        if conditioning is not None and conditioning.image is not None:  # the image's bucket, not the default size
            sized = self.drawn_size(conditioning.image, IMG2IMG)
            width, height = (sized[0] if width is None else width), (sized[1] if height is None else height)
        return super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                               conditioning=conditioning, makes_images=makes_images, **options)

    def call_kwargs(self, settings):
        taken = self.task_call_defaults(IMG2IMG)
        return {name: value for name, value in super().call_kwargs(settings).items() if name in taken}
