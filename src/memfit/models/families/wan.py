"""WanPipeline, text to video (UMT5 text encoder, Wan 3D transformer, Wan 3D VAE).

The output is a video: memfit's `images` are its frames (PIL), as `WanPipeline(...).frames[0]`
with output_type="pil". `num_frames` (Settings field, default: the pipeline's 81) must be
4k+1, which the pipeline would otherwise round silently; memfit refuses other counts.
A Wan 2.2 A14B folder has two experts of one architecture: transformer runs the high-noise steps and
transformer_2 the low-noise ones (timesteps below boundary_ratio * num_train_timesteps). Both load in
the denoise stage, but only one runs at a time: the plan sizes each apart (the stage needs the larger
expert, not both), the first is placed as the stage starts and the second is brought in at its first
call, the boundary, when the first is released to its file (``experts``). ``guidance_scale_2`` (Settings
field, --guidance-2) guides the low-noise steps; without it the pipeline guides them with guidance too.

Input image (--image, the img2img task): Wan 2.2 TI2V-5B, a WanPipeline folder whose model_index.json has
``expand_timesteps: true``, also makes a video from an image. WanPipeline itself takes none in this diffusers
version: its image path is WanImageToVideoPipeline's (the same folder loaded as that class, as diffusers does),
whose loop set-up encodes the image with the VAE's encoder (loaded and planned in the denoise stage) and keeps
its latents as the first latent frame at timestep 0. Other WanPipeline folders refuse --image; image-to-video
folders (WanImageToVideoPipeline: Wan 2.1 I2V, Wan 2.2 I2V A14B) are memfit.models.families.wan_i2v's.
With an image and no --width/--height, the video has the image's aspect ratio at the area of __call__'s default
832 x 480 (or memfit_defaults.json's width x height), each side rounded down to the transformer's patch in
pixels (size_multiple), as diffusers' WanImageToVideoPipeline example computes it. That pipeline cleans prompts
with ftfy, which its diffusers module uses without checking that it is installed: a run with an image is refused
before anything loads when ftfy is missing.

Unequal lengths: native. The pipeline runs the conditional and unconditional passes as separate
transformer calls and compares no shapes; the transformer takes no text mask (encode_prompt already
zero-pads every prompt to max_sequence_length, so its own embeddings are equal in length).
"""

from __future__ import annotations

import math

import torch

from memfit.errors import MemfitError
from memfit.models.families.base import IMG2IMG, PipelineAdapter, check_frame_count, paired_embeddings


class WanAdapter(PipelineAdapter):
    class_name = "WanPipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "transformer_2", "scheduler")
    experts = ("transformer", "transformer_2")  # in the order the pipeline's loop runs them
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "native: the pipeline runs the two guidance passes separately"
    max_text_tokens = 512
    guidance_batch = 1  # the negative pass is a separate transformer call
    separate_guidance_passes = True
    options = ("num_frames", "guidance_scale_2")
    # Wan 2.2 TI2V-5B's image path (WanPipeline folders without expand_timesteps refuse --image: takes_image).
    tasks = {IMG2IMG: "WanImageToVideoPipeline"}

    def takes_image(self) -> bool:
        """Whether this folder makes a video from an input image: Wan 2.2 TI2V-5B (expand_timesteps) does."""
        return bool(self.pipeline_options.get("expand_timesteps"))

    def vae_scale_factor(self) -> int:
        return self.configs["vae"].get("scale_factor_spatial", 8)

    def temporal_scale_factor(self) -> int:
        return self.configs["vae"].get("scale_factor_temporal", 4)

    def size_multiple(self) -> int:
        # WanPipeline.check_inputs needs 16; __call__ then rounds a side down, silently, to the VAE's scale times the
        # transformer's patch (32 with Wan 2.2 TI2V-5B's 16x VAE): memfit refuses a side that would be changed.
        patch = self._patch_size()
        return math.lcm(16, self.vae_scale_factor() * patch[1], self.vae_scale_factor() * patch[2])

    def _patch_size(self) -> tuple[int, int, int]:
        config = self.configs.get("transformer", self.configs.get("transformer_2", {}))
        return tuple(config.get("patch_size", (1, 2, 2)))

    def default_size(self) -> int:
        return self.call_defaults()["height"]  # not square: resolve() takes __call__'s width and height

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                conditioning=None, makes_images: bool = True, **options):
        call_defaults = self.call_defaults()
        defaults = defaults or {}
        image = None if conditioning is None else conditioning.image
        if image is not None:
            if not self.takes_image():
                raise MemfitError(
                    f"This {self.class_name} folder makes video from text only and takes no --image (only Wan 2.2 "
                    "TI2V-5B, whose model_index.json has expand_timesteps: true, does); for image to video use a "
                    "WanImageToVideoPipeline folder (Wan 2.1 I2V, Wan 2.2 I2V A14B).")
            check_prompt_cleaning()
            sized_width, sized_height = self.size_for(image, defaults)
            width = sized_width if width is None else width
            height = sized_height if height is None else height
        width = width if width is not None else defaults.get("width", call_defaults["width"])
        height = height if height is not None else defaults.get("height", call_defaults["height"])
        settings = super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                                   conditioning=conditioning, makes_images=makes_images, **options)
        if settings.guidance_scale_2 is not None and "transformer_2" not in self.configs:
            raise MemfitError(
                f"guidance_scale_2 guides Wan 2.2's second expert (transformer_2), which this {self.class_name} "
                "folder does not have; leave --guidance-2 out.")
        check_frame_count(settings.num_frames, self.temporal_scale_factor(), self.class_name)
        if makes_images:
            self._check_position_table(settings)
        return settings

    def size_for(self, image, defaults: dict) -> tuple[int, int]:
        """(width, height) for an input image without --width/--height: its aspect ratio at the default area."""
        call_defaults = self.call_defaults()
        area = defaults.get("width", call_defaults["width"]) * defaults.get("height", call_defaults["height"])
        step = self.size_multiple()
        aspect = image.height / image.width
        height = max(step, round(math.sqrt(area * aspect)) // step * step)
        width = max(step, round(math.sqrt(area / aspect)) // step * step)
        return width, height

    def _check_position_table(self, settings) -> None:
        """Refuse a size the transformers' rotary position tables do not reach, before anything loads (diffusers
        would fail on a tensor shape in the first step): a table has rope_max_seq_len rows for each axis, one
        per latent patch along it."""
        spatial, temporal, multiple = self.vae_scale_factor(), self.temporal_scale_factor(), self.size_multiple()
        for name in ("transformer", "transformer_2"):
            config = self.configs.get(name)
            if config is None:
                continue
            rows = config.get("rope_max_seq_len", 1024)
            patch_frames, patch_height, patch_width = config.get("patch_size", (1, 2, 2))
            width = rows * patch_width * spatial // multiple * multiple
            height = rows * patch_height * spatial // multiple * multiple
            frames = (rows * patch_frames - 1) * temporal + 1
            if settings.width > width or settings.height > height or settings.num_frames > frames:
                raise MemfitError(
                    f"{settings.width}x{settings.height} with {settings.num_frames} frames is more than this "
                    f"{self.class_name}'s {name} takes: its rotary position table ({name}/config.json: "
                    f"rope_max_seq_len {rows}) reaches at most {width}x{height} with {frames} frames, so pass a "
                    f"smaller --width, --height or --frames.")

    def latent_frames(self, settings) -> int:
        return (settings.num_frames - 1) // self.temporal_scale_factor() + 1

    def call_kwargs(self, settings):
        kwargs = dict(super().call_kwargs(settings), num_frames=settings.num_frames)
        if settings.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = settings.guidance_scale_2
        return kwargs

    def encode(self, pipe, settings, with_negative):
        positive, negative = pipe.encode_prompt(
            prompt=settings.prompt,
            negative_prompt=settings.negative_prompt,
            do_classifier_free_guidance=with_negative,
            num_videos_per_prompt=1,
            max_sequence_length=512,  # __call__'s default
            device=pipe._execution_device,
        )
        return paired_embeddings(with_negative, prompt_embeds=(positive, negative))

    def denoise_call(self, pipe, embeddings, settings, generator, **inputs):
        if pipe.vae is None:  # what WanPipeline.__init__ reads from the VAE it does not have in this stage
            pipe.vae_scale_factor_spatial = self.vae_scale_factor()
            pipe.vae_scale_factor_temporal = self.temporal_scale_factor()
        return super().denoise_call(pipe, embeddings, settings, generator, **inputs)

    def decode(self, pipe, latents, settings, generator):
        # Copied from WanPipeline.__call__ after its denoising loop (output_type="pil"); the frames of the video.
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = pipe.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        latents = latents / latents_std + latents_mean
        video = vae.decode(latents, return_dict=False)[0]
        return list(pipe.video_processor.postprocess_video(video, output_type="pil")[0])


def check_prompt_cleaning() -> None:
    """Refuse a run WanImageToVideoPipeline would fail in its first step for want of ftfy (a NameError)."""
    from diffusers.pipelines.wan import pipeline_wan_i2v

    if getattr(pipeline_wan_i2v, "ftfy", None) is None:
        raise MemfitError("WanImageToVideoPipeline cleans prompts with the ftfy package, which is not installed; "
                          "install it (pip install ftfy) and run again.")
