"""SanaPipeline (Gemma-2 text encoder with attention masks, Sana linear-attention DiT, DC-AE VAE).

Like SD, Sana batches the unconditional and conditional passes into one transformer call
(torch.cat of negative and positive embeddings and masks), and its check_inputs refuses
embeddings or masks of different shapes. The transformer masks text tokens (mask 0 becomes a
-10000 attention bias, whose softmax weight is exactly 0 at fp32), so memfit pads the shorter
embedding with zeros and its mask with zeros, the same thing the tokenizer's own padding to
max_sequence_length does.

Resolution binning: __call__ (use_resolution_binning=True, its default) runs at the nearest size of
its aspect-ratio table and resizes the decoded image back to the requested size. The decode needs
that requested size, which the decode stage is not given (PipelineAdapter.decode takes only the
latents), so denoise() records it on the adapter (`output_size`) for the decode of the same run.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.models.families.base import PipelineAdapter, pad_to_length


class SanaAdapter(PipelineAdapter):
    class_name = "SanaPipeline"
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "pad the shorter embedding with masked zeros (attention mask 0)"
    max_text_tokens = 300
    # Set by denoise(): the size the decoded image is resized back to (resolution binning).
    output_size: tuple[int, int] | None = None

    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.configs["vae"]["encoder_block_out_channels"]) - 1)

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * self.configs["transformer"].get("patch_size", 1)

    def default_size(self) -> int:
        return self.configs["transformer"]["sample_size"] * self.vae_scale_factor()

    def encode(self, pipe, settings, with_negative):
        call_defaults = self.call_defaults()
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            settings.prompt,
            do_classifier_free_guidance=with_negative,
            negative_prompt=settings.negative_prompt or call_defaults["negative_prompt"],
            num_images_per_prompt=1,
            device=pipe._execution_device,
            clean_caption=call_defaults["clean_caption"],
            max_sequence_length=call_defaults["max_sequence_length"],
            complex_human_instruction=call_defaults["complex_human_instruction"],
        )
        embeddings = {"prompt_embeds": positive, "prompt_attention_mask": positive_mask}
        if with_negative:
            embeddings["negative_prompt_embeds"] = negative
            embeddings["negative_prompt_attention_mask"] = negative_mask
        return embeddings

    def denoise(self, pipe, embeddings, settings, generator, split=False):
        if split:
            raise MemfitError(f"{self.class_name} cannot split its guidance passes; plan it without 'split'.")
        guided = self.uses_guidance(settings.guidance)
        kwargs = self.embedding_kwargs(embeddings, guided)
        if guided and kwargs["negative_prompt_embeds"].shape[1] != kwargs["prompt_embeds"].shape[1]:
            length = max(kwargs["negative_prompt_embeds"].shape[1], kwargs["prompt_embeds"].shape[1])
            for prefix in ("", "negative_"):
                kwargs[f"{prefix}prompt_embeds"] = pad_to_length(kwargs[f"{prefix}prompt_embeds"], length)
                kwargs[f"{prefix}prompt_attention_mask"] = pad_to_length(kwargs[f"{prefix}prompt_attention_mask"], length)
        self.output_size = (settings.width, settings.height)
        # negative_prompt=None: __call__ defaults it to "", which check_inputs refuses next to negative embeddings.
        return pipe(**kwargs, **self.call_kwargs(settings), negative_prompt=None, generator=generator,
                    output_type="latent").images

    def decode(self, pipe, latents, generator):
        # Copied from SanaPipeline.__call__ after its denoising loop (use_resolution_binning=True).
        if self.output_size is None:
            raise MemfitError("SanaPipeline's decode resizes to the requested size: run denoise first, with this adapter.")
        orig_width, orig_height = self.output_size
        latents = latents.to(pipe.vae.dtype)
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        image = pipe.image_processor.resize_and_crop_tensor(image, orig_width, orig_height)
        return pipe.image_processor.postprocess(image, output_type="pil")
