"""PixArtSigmaPipeline (T5 text encoder with attention masks, PixArt DiT, SDXL-style VAE).

Like SD, PixArt-Sigma batches the unconditional and conditional passes into one transformer call
(torch.cat of negative and positive embeddings and masks), and its check_inputs refuses
embeddings or masks of different shapes. The transformer masks text tokens (mask 0 becomes a
-10000 attention bias, whose softmax weight is exactly 0 at fp32), so memfit pads the shorter
embedding with zeros and its mask with zeros, the same thing the tokenizer's own padding to
max_sequence_length does.

Resolution binning: __call__ (use_resolution_binning=True, its default) runs at the nearest size of
its aspect-ratio table, and decode resizes the image back to the requested size (the settings').
SanaPipeline works the same way (memfit.models.families.sana).
"""

from __future__ import annotations

import contextlib

from memfit.models.families.base import PipelineAdapter, masked_embeddings, pad_masked


class PixArtSigmaAdapter(PipelineAdapter):
    class_name = "PixArtSigmaPipeline"
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "pad the shorter embedding with masked zeros (attention mask 0)"
    max_text_tokens = 300
    # The encode_prompt arguments this pipeline's __call__ passes on from its own defaults.
    encode_options = ("clean_caption", "max_sequence_length")

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * self.configs["transformer"].get("patch_size", 2)

    def encode(self, pipe, settings, with_negative):
        call_defaults = self.call_defaults()
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            settings.prompt,
            do_classifier_free_guidance=with_negative,
            negative_prompt=settings.negative_prompt or call_defaults["negative_prompt"],
            num_images_per_prompt=1,
            device=pipe._execution_device,
            **{name: call_defaults[name] for name in self.encode_options},
        )
        return masked_embeddings(positive, positive_mask, negative, negative_mask, with_negative)

    def fit_lengths(self, pipe, embeddings, lengths):
        return pad_masked(embeddings), contextlib.nullcontext()

    def denoise_call(self, pipe, embeddings, settings, generator, **inputs):
        # negative_prompt=None: __call__ defaults it to "", which check_inputs refuses next to negative embeddings.
        return super().denoise_call(pipe, embeddings, settings, generator, negative_prompt=None, **inputs)

    def decode(self, pipe, latents, settings, generator):
        # Copied from PixArtSigmaPipeline.__call__ (and SanaPipeline's) after the denoising loop
        # (use_resolution_binning=True): back to the requested size.
        image = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
        image = pipe.image_processor.resize_and_crop_tensor(image, settings.width, settings.height)
        return pipe.image_processor.postprocess(image, output_type="pil")
