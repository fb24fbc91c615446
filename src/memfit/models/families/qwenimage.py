"""QwenImagePipeline (Qwen2.5-VL text encoder, QwenImage MMDiT transformer, QwenImage 3D VAE).

Guidance: QwenImage's classifier-free guidance is its `true_cfg_scale` (default 4.0); its
`guidance_scale` only feeds guidance-distilled transformers (guidance_embeds=True), which memfit
does not support yet. memfit's `guidance` is therefore passed as true_cfg_scale, with
guidance_scale=None, and, as in diffusers, guidance runs only when it is > 1 *and* a negative prompt
is given.

Unequal lengths: native. The pipeline runs the conditional and unconditional passes as separate
transformer calls, each with its own embedding and mask, and its check_inputs compares no shapes.
The masks are left exactly as encode_prompt returns them: None where every token is valid (then
the transformer attends without a mask), so a prompt's embedding tensors may come with or without
a `*_mask` entry.

Latents are packed in 2x2 patches (memfit.models.families.packed_latents): the denoise stage
hands them over unpacked into the VAE's layout; decode copies the rest of the pipeline's post-loop code.
"""

from __future__ import annotations

import torch

from memfit.errors import MemfitError
from memfit.models.families.packed_latents import PackedLatentsAdapter


class QwenImageAdapter(PackedLatentsAdapter):
    class_name = "QwenImagePipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "native: the pipeline runs the two guidance passes separately, each with its own mask"
    max_text_tokens = 1024
    guidance_batch = 1  # the negative pass is a separate transformer call
    separate_guidance_passes = True

    def __init__(self, configs, classes=None):
        super().__init__(configs, classes)
        if configs.get("transformer", {}).get("guidance_embeds"):
            raise MemfitError(
                "This QwenImage transformer is guidance-distilled (guidance_embeds=True), which memfit does not "
                "support yet; only QwenImage models with true classifier-free guidance are."
            )

    def call_defaults(self):
        defaults = super().call_defaults()
        defaults["guidance_scale"] = defaults["true_cfg_scale"]  # memfit's guidance is QwenImage's true CFG
        return defaults

    def vae_scale_factor(self) -> int:
        return 2 ** len(self.configs["vae"]["temperal_downsample"])

    def guided(self, settings) -> bool:
        # QwenImagePipeline: do_true_cfg = true_cfg_scale > 1 and has_neg_prompt.
        return settings.guidance > 1 and settings.negative_prompt is not None

    def call_kwargs(self, settings):
        return dict(num_inference_steps=settings.steps, true_cfg_scale=settings.guidance, guidance_scale=None,
                    height=settings.height, width=settings.width)

    def encode(self, pipe, settings, with_negative):
        device = pipe._execution_device
        embeddings = {}
        prompts = [("", settings.prompt)] + ([("negative_", settings.negative_prompt or "")] if with_negative else [])
        for prefix, prompt in prompts:
            embeds, mask = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1,
                                              max_sequence_length=512)  # __call__'s default
            embeddings[f"{prefix}prompt_embeds"] = embeds
            if mask is not None:
                embeddings[f"{prefix}prompt_embeds_mask"] = mask
        return embeddings

    def embedding_kwargs(self, embeddings, guided):
        if not guided:
            return {name: value for name, value in embeddings.items() if not name.startswith("negative_")}
        if "negative_prompt_embeds" not in embeddings:
            raise MemfitError(
                "Guidance needs negative prompt embeddings, but negative_prompt_embeds is missing; re-encode with "
                "memfit encode, or pass --guidance 1 to generate without guidance."
            )
        return dict(embeddings)

    def decode(self, pipe, latents, settings, generator):
        # Copied from QwenImagePipeline.__call__ after its denoising loop (_unpack_latents ran in denoise).
        vae = pipe.vae
        latents = latents.to(vae.dtype)
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        latents = latents / latents_std + latents_mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pil")
