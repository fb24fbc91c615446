"""ZImagePipeline (Qwen3 text encoder, Z-Image single-stream transformer, Flux VAE), Z-Image and Z-Image-Turbo.

Guidance: ZImagePipeline runs classifier-free guidance whenever guidance_scale > 0 (not > 1), as
pos + guidance * (pos - neg), with "" as the negative prompt where none is given; Turbo is run at 0.

Embeddings: encode_prompt returns each prompt's embedding as a list entry of its own length (the
Qwen3 hidden states of its valid tokens only, padding dropped). memfit stores the one prompt's entry
as a [1, tokens, width] tensor, like every other family's, and hands the pipeline the list back.

Unequal lengths: native. The pipeline passes the positive and negative embeddings in one batched
transformer call as a list, and the transformer pads and masks each entry itself.

The pipeline's latents are not packed: __call__ with output_type="latent" returns them in the VAE's
layout, and decode copies the rest of its post-loop code.
"""

from __future__ import annotations

from memfit.models.families.base import PipelineAdapter, paired_embeddings


class ZImageAdapter(PipelineAdapter):
    class_name = "ZImagePipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "native: the pipeline passes each embedding at its own length and the transformer pads and masks them"
    max_text_tokens = 512

    def uses_guidance(self, guidance: float) -> bool:
        return guidance > 0  # ZImagePipeline.do_classifier_free_guidance

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * 2  # the transformer sees 2x2 latent patches

    def default_size(self) -> int:
        # ZImagePipeline.__call__ draws at 1024 x 1024 by default: 128 latents a side with the 8x VAE of every
        # Z-Image model (a tiny test VAE's scale keeps the side as small in latents).
        return 128 * self.vae_scale_factor()

    def encode(self, pipe, settings, with_negative):
        positive, negative = pipe.encode_prompt(
            prompt=settings.prompt,
            negative_prompt=settings.negative_prompt,
            do_classifier_free_guidance=with_negative,
            device=pipe._execution_device,
            max_sequence_length=512,  # __call__'s default
        )
        # One prompt: each list holds one entry, kept as a batch of one.
        return paired_embeddings(with_negative, prompt_embeds=(positive[0][None], negative[0][None] if with_negative else None))

    def embedding_kwargs(self, embeddings, guided):
        # The pipeline takes a list with one [tokens, width] entry per prompt.
        return {name: list(tensor) for name, tensor in super().embedding_kwargs(embeddings, guided).items()}

    def decode(self, pipe, latents, settings, generator):
        # Copied from ZImagePipeline.__call__ after its denoising loop.
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = pipe.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
