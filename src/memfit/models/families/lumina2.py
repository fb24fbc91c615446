"""Lumina2Pipeline (Gemma2 text encoder).

Lumina2 already runs the conditional and unconditional passes separately, each with its own
attention mask, but its check_inputs demands equal shapes. memfit pads the shorter embedding with
zeros on the right and extends its attention mask with zeros, so the padded positions are masked
out of attention: the same thing Lumina2's own tokenizer padding (to 256 tokens) does.
"""

from __future__ import annotations

import contextlib

from memfit.models.families.base import PipelineAdapter, masked_embeddings, pad_masked


class Lumina2Adapter(PipelineAdapter):
    class_name = "Lumina2Pipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "pad the shorter embedding with masked zeros (attention mask 0)"
    max_text_tokens = 256
    separate_guidance_passes = True

    def vae_scale_factor(self) -> int:
        return 8  # Lumina2Pipeline hard-codes it, whatever the VAE.

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * 2

    def encode(self, pipe, settings, with_negative):
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            settings.prompt,
            do_classifier_free_guidance=with_negative,
            negative_prompt=settings.negative_prompt,
            num_images_per_prompt=1,
            device=pipe._execution_device,
        )
        return masked_embeddings(positive, positive_mask, negative, negative_mask, with_negative)

    def fit_lengths(self, pipe, embeddings, lengths):
        return pad_masked(embeddings), contextlib.nullcontext()

    def decode(self, pipe, latents, settings, generator):
        # Copied from Lumina2Pipeline.__call__ after its denoising loop.
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")

