"""LTXPipeline (LTX-Video), text to video: a T5 text encoder with attention masks, the LTX video transformer and its
32x (8x in time) video VAE, whose decoder may be conditioned on a timestep (LTX-Video 0.9.1 and later).

The output is a video: memfit's `images` are its frames (PIL), as `LTXPipeline(...).frames[0]` with
output_type="pil". `num_frames` (Settings field, default: the pipeline's 161) must be 8k+1 (the VAE's temporal
compression plus 1) and each side a multiple of 32 (check_inputs) and of the VAE's scale times the transformer's
patch; the pipeline would otherwise drop the frames and pixels that do not fill a latent silently: memfit refuses
other counts and sizes. Without --width/--height the video has __call__'s default size, 704 x 512.

Like PixArt-Sigma (memfit.models.families.pixart_sigma), the pipeline batches the unconditional and conditional
passes into one transformer call (torch.cat of negative and positive embeddings and masks), and its check_inputs
refuses embeddings or masks of different shapes. encode_prompt pads every prompt to 128 tokens, so its own are
equal; shorter ones (an --embeddings file cut by hand) are padded with masked zeros: the transformer turns mask 0
into a -10000 attention bias, whose softmax weight is exactly 0 at fp32, as the tokenizer's padding is.

The pipeline's __init__ takes the VAE's compression ratios from the VAE where it has one and falls back to 32 and
8 where it does not (the denoise stage): that stage sets the folder's. The denoising loop ends with packed
latents (one token per latent patch): the denoise stage unpacks them (after_loop), the decode stage runs the rest of
__call__'s post-loop code: the VAE's latents_mean/latents_std, the decode timestep (with its noise, drawn from the
run's generator as plain diffusers draws it, whether or not decode_noise_scale is 0) and the VAE, which decodes every
frame at once (no tiling; memfit.plan.meta.WHOLE_VIDEO_DECODERS). __call__'s decode_timestep and decode_noise_scale
are its defaults (0 and 0): memfit takes neither yet. --lora goes into the transformer, through the pipeline's own
load_lora_weights (diffusers' LTX-Video loader reads no text encoder LoRA).

Input image (--image, the img2img task): an LTX-Video folder also makes a video from an image, its first frame, as
LTXImageToVideoPipeline (the same components; diffusers loads the same folder as that class). Its loop set-up
encodes the image with the VAE's encoder (loaded and planned in the denoise stage) and keeps its latents as the
first latent frame, at timestep 0. Without --width/--height the video has the image's aspect ratio at the area of
__call__'s default 704 x 512, each side rounded down to a multiple of 32 (the pipeline resizes the image to the
video's size). Its post-loop code differs in two lines: it draws the decode timestep's noise with torch.randn on the
execution device (memfit draws it on the generator's, the CPU, where a CPU generator can draw: the same numbers on
a CPU run) and does not cast the latents to the VAE's dtype (the same dtype in a memfit run). A folder saved as
LTXImageToVideoPipeline is memfit.models.families.ltx_i2v's.
"""

from __future__ import annotations

import contextlib
import math

import torch

from memfit.models.families.base import IMG2IMG, PipelineAdapter, check_frame_count, masked_embeddings, pad_masked


class LTXFamilyAdapter(PipelineAdapter):
    """What LTX-Video's and LTX-2's pipelines (memfit.models.families.ltx2) share: a video VAE that compresses by
    its patch times 2 for each block that scales, each side a multiple of 32 and of that scale times the
    transformer's patch, frames a multiple of the temporal compression plus 1 (8k+1), __call__'s default width and height (not
    square; with an input image, its aspect ratio at their area), and encode_prompt's embeddings and masks."""

    options = ("num_frames",)

    def vae_scale_factor(self) -> int:
        return self._compression("spatial_compression_ratio", "patch_size", 4)

    def temporal_scale_factor(self) -> int:
        return self._compression("temporal_compression_ratio", "patch_size_t", 1)

    def _compression(self, stated: str, patch: str, default_patch: int) -> int:
        """A compression ratio of the video VAE, as its class computes it where its config does not state it: its
        patch times 2 for each block that scales (in space and time alike)."""
        vae = self.configs.get("vae", {})
        if vae.get(stated) is not None:
            return int(vae[stated])
        return int(vae.get(patch, default_patch)) * 2 ** sum(bool(flag) for flag in self._scaling_blocks())

    def _scaling_blocks(self):
        """The VAE's spatio_temporal_scaling, with AutoencoderKLLTXVideo's default."""
        return self.configs.get("vae", {}).get("spatio_temporal_scaling", (True, True, True, False))

    def size_multiple(self) -> int:
        # check_inputs needs 32; prepare_latents takes height // scale latent rows, which the transformer patches.
        patch = int(self.configs.get("transformer", {}).get("patch_size", 1))
        return math.lcm(32, self.vae_scale_factor() * patch)

    def default_size(self) -> int:
        return self.call_defaults()["height"]  # not square: resolve() takes __call__'s width and height

    def drawn_size(self, image, task):
        """(width, height) for an input image without --width/--height: its aspect ratio at __call__'s default area."""
        call_defaults = self.call_defaults()
        area, step = call_defaults["width"] * call_defaults["height"], self.size_multiple()
        aspect = image.height / image.width
        return (max(step, round(math.sqrt(area / aspect)) // step * step),
                max(step, round(math.sqrt(area * aspect)) // step * step))

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                conditioning=None, makes_images: bool = True, **options):
        call_defaults = self.call_defaults()
        defaults = defaults or {}
        if conditioning is None or conditioning.image is None:  # with an image, the image's size (drawn_size)
            width = width if width is not None else defaults.get("width", call_defaults["width"])
            height = height if height is not None else defaults.get("height", call_defaults["height"])
        settings = super().resolve(prompt, negative_prompt, steps, guidance, seed, width, height, defaults,
                                   conditioning=conditioning, makes_images=makes_images, **options)
        check_frame_count(settings.num_frames, self.temporal_scale_factor(), self.class_name)
        return settings

    def latent_frames(self, settings) -> int:
        return (settings.num_frames - 1) // self.temporal_scale_factor() + 1

    def call_kwargs(self, settings):
        return dict(super().call_kwargs(settings), num_frames=settings.num_frames)

    def encode(self, pipe, settings, with_negative):
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            prompt=settings.prompt,
            negative_prompt=settings.negative_prompt,
            do_classifier_free_guidance=with_negative,
            num_videos_per_prompt=1,
            max_sequence_length=self.call_defaults()["max_sequence_length"],
            device=pipe._execution_device,
        )
        return masked_embeddings(positive, positive_mask, negative, negative_mask, with_negative)

    def _set_vae_compression(self, pipe):
        """What __init__ reads from the video VAE, where the stage does not load it (the denoise stage)."""
        if pipe.vae is None:
            pipe.vae_spatial_compression_ratio = self.vae_scale_factor()
            pipe.vae_temporal_compression_ratio = self.temporal_scale_factor()


class LTXAdapter(LTXFamilyAdapter):
    class_name = "LTXPipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "pad the shorter embedding with masked zeros (attention mask 0)"
    max_text_tokens = 128  # __call__'s max_sequence_length
    frames_per_second = 25  # __call__'s frame_rate, which its rotary positions are scaled to
    tasks = {IMG2IMG: "LTXImageToVideoPipeline"}

    def fit_lengths(self, pipe, embeddings, lengths):
        return pad_masked(embeddings), contextlib.nullcontext()

    def denoise_call(self, pipe, embeddings, settings, generator, **inputs):
        self._set_vae_compression(pipe)
        return super().denoise_call(pipe, embeddings, settings, generator, **inputs)

    def after_loop(self, pipe, latents, settings):
        # The first step of __call__'s post-loop code: the packed tokens back to (batch, channels, frames, h, w).
        scale = pipe.vae_spatial_compression_ratio
        return pipe._unpack_latents(latents, self.latent_frames(settings), settings.height // scale,
                                    settings.width // scale, pipe.transformer_spatial_patch_size,
                                    pipe.transformer_temporal_patch_size)

    def decode(self, pipe, latents, settings, generator):
        # Copied from LTXPipeline.__call__ after its denoising loop (output_type="pil", decode_timestep and
        # decode_noise_scale at their defaults); the frames of the video. Its cast to the prompt embeddings' dtype
        # is the VAE's: memfit runs every component in one dtype.
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = pipe.vae
        device = get_module_execution_device(vae)
        latents = pipe._denormalize_latents(latents.to(device), vae.latents_mean, vae.latents_std,
                                            vae.config.scaling_factor).to(vae.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            noise = self.decode_noise(latents, settings, generator, device)
            timestep = torch.tensor([0.0], device=device, dtype=latents.dtype)  # decode_timestep
            noise_scale = torch.tensor([0.0], device=device, dtype=latents.dtype)[:, None, None, None, None]
            latents = (1 - noise_scale) * latents + noise_scale * noise
        video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
        return list(pipe.video_processor.postprocess_video(video, output_type="pil")[0])

    def decode_noise(self, latents, settings, generator, device):
        """The noise __call__ draws for the decode timestep (LTXImageToVideoPipeline's: torch.randn)."""
        from diffusers.utils.torch_utils import randn_tensor

        if settings.task == IMG2IMG:
            return torch.randn(latents.shape, generator=generator, device=generator.device,
                               dtype=latents.dtype).to(device)
        return randn_tensor(latents.shape, generator=generator, device=device, dtype=latents.dtype)
