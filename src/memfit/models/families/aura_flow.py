"""AuraFlowPipeline (UMT5 text encoder, AuraFlow MMDiT transformer, SDXL-style VAE).

Like SD, AuraFlow batches the unconditional and conditional passes into one transformer call
(torch.cat of negative and positive embeddings), and its check_inputs refuses embeddings or masks
of different shapes. Its transformer takes no text mask (encode_prompt only zeroes the padded
positions, which the transformer still attends to), so padding cannot be masked: memfit runs the
two passes separately, as StableDiffusionAdapter does for the UNet. memfit pads
the shorter embedding and mask so the pipeline's check and torch.cat pass, and `split_transformer_passes` swaps in a
transformer forward that cuts each half back to its true length and calls the transformer once per
half. With equal lengths nothing is changed, so the pipeline's own batched path runs.
"""

from __future__ import annotations

import torch

from memfit.models.families.base import PipelineAdapter, masked_embeddings, pad_to_length, split_transformer_passes


class AuraFlowAdapter(PipelineAdapter):
    class_name = "AuraFlowPipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "split guidance passes (two transformer calls, each on its unpadded embeddings)"
    max_text_tokens = 256
    splits_guidance = True

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * self.configs["transformer"].get("patch_size", 2)

    def encode(self, pipe, settings, with_negative):
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            prompt=settings.prompt,
            negative_prompt=settings.negative_prompt,
            do_classifier_free_guidance=with_negative,
            num_images_per_prompt=1,
            device=pipe._execution_device,
            max_sequence_length=self.call_defaults()["max_sequence_length"],
        )
        return masked_embeddings(positive, positive_mask, negative, negative_mask, with_negative)

    def split_passes(self, pipe, lengths):
        return split_transformer_passes(pipe.transformer, *lengths["prompt_embeds"])

    def pad_to_longest(self, embeddings, lengths):
        padded = super().pad_to_longest(embeddings, lengths)
        length = max(lengths["prompt_embeds"])
        for prefix in ("", "negative_"):
            mask = embeddings.get(f"{prefix}prompt_attention_mask")
            if mask is not None:  # encode_prompt's mask is the embedding's, flattened: [B, L * D]
                embeds = embeddings[f"{prefix}prompt_embeds"]
                padded[f"{prefix}prompt_attention_mask"] = pad_to_length(mask.reshape(embeds.shape), length).flatten(1)
        return padded

    def decode(self, pipe, latents, settings, generator):
        # Copied from AuraFlowPipeline.__call__ after its denoising loop.
        needs_upcasting = pipe.vae.dtype == torch.float16 and pipe.vae.config.force_upcast
        if needs_upcasting:
            pipe.upcast_vae()
        image = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
