"""StableDiffusion3Pipeline (CLIP-L, CLIP-G and T5 text encoders, SD3 MMDiT transformer).

The prompt embedding is the two CLIP embeddings (77 tokens) followed by T5's (256 tokens by
default); the pooled embedding is both CLIP projections. Like SD, the pipeline batches the
unconditional and conditional passes into one transformer call (torch.cat of negative and
positive embeddings), which cannot take embeddings of different lengths, and its check_inputs
refuses them. memfit then runs the two passes separately, as StableDiffusionAdapter does for the
UNet: the shorter embedding is padded so the pipeline's check and torch.cat pass, and
`split_transformer_passes` swaps in a transformer forward that cuts each half back to its true length and calls the
transformer once per half. With equal lengths nothing is changed, so the pipeline's own batched
path runs. The SD3 transformer takes no text attention mask, so padding could not be masked instead.
"""

from __future__ import annotations

from memfit.models.families.base import PipelineAdapter, paired_embeddings, split_transformer_passes


class StableDiffusion3Adapter(PipelineAdapter):
    class_name = "StableDiffusion3Pipeline"
    takes_lora = True
    encode_components = ("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2", "text_encoder_3")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")
    unequal_lengths = "split guidance passes (two transformer calls, each on its unpadded embeddings)"
    max_text_tokens = 77 + 256
    splits_guidance = True

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * self.configs["transformer"].get("patch_size", 2)

    def encode(self, pipe, settings, with_negative):
        positive, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=settings.prompt,
            prompt_2=None,
            prompt_3=None,
            device=pipe._execution_device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=with_negative,
            negative_prompt=settings.negative_prompt,
        )
        return paired_embeddings(with_negative, prompt_embeds=(positive, negative),
                                 pooled_prompt_embeds=(pooled, negative_pooled))

    def split_passes(self, pipe, lengths):
        return split_transformer_passes(pipe.transformer, *lengths["prompt_embeds"])

    def decode(self, pipe, latents, settings, generator):
        # Copied from StableDiffusion3Pipeline.__call__ after its denoising loop.
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
