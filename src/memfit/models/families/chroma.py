"""ChromaPipeline (T5 text encoder with attention masks, Chroma MMDiT transformer, Flux VAE).

Chroma has real classifier-free guidance (`guidance` > 1, its guidance_scale), run as two
separate transformer calls per step, each with its own embedding, attention mask and text ids.

Unequal lengths: native. check_inputs compares no shapes and each pass builds its mask and text ids
from its own embedding, so embeddings of different lengths go through unchanged.

Latents are packed in 2x2 patches (memfit.models.families.packed_latents): the denoise stage
hands them over unpacked into the VAE's layout; decode copies the rest of the pipeline's post-loop code.
"""

from __future__ import annotations

from memfit.models.families.base import masked_embeddings
from memfit.models.families.packed_latents import PackedLatentsAdapter


class ChromaAdapter(PackedLatentsAdapter):
    class_name = "ChromaPipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "native: the pipeline runs the two guidance passes separately, each with its own mask"
    max_text_tokens = 512
    guidance_batch = 1  # the negative pass is a separate transformer call
    separate_guidance_passes = True

    def encode(self, pipe, settings, with_negative):
        positive, _, positive_mask, negative, _, negative_mask = pipe.encode_prompt(
            prompt=settings.prompt,
            negative_prompt=settings.negative_prompt,
            device=pipe._execution_device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=with_negative,
        )
        return masked_embeddings(positive, positive_mask, negative, negative_mask, with_negative)

    def decode(self, pipe, latents, settings, generator):
        # Copied from ChromaPipeline.__call__ after its denoising loop (_unpack_latents ran in denoise).
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
