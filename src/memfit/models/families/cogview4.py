"""CogView4Pipeline (GLM text encoder).

CogView4 runs the conditional and unconditional transformer passes separately and its
check_inputs compares only batch size and width, so unequal lengths ([1,144,D] vs [1,48,D], the
case reported from the field) need nothing from memfit: the embeddings go through unchanged.
"""

from __future__ import annotations

from memfit.models.families.base import PipelineAdapter, paired_embeddings


class CogView4Adapter(PipelineAdapter):
    class_name = "CogView4Pipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "native: the pipeline runs the two guidance passes separately"
    max_text_tokens = 1024
    guidance_batch = 1  # the pipeline runs the two guidance passes separately
    separate_guidance_passes = True

    def size_multiple(self) -> int:
        return 16

    def default_size(self) -> int:
        return self.configs["transformer"].get("sample_size", 128) * self.vae_scale_factor()

    def encode(self, pipe, settings, with_negative):
        positive, negative = pipe.encode_prompt(
            settings.prompt,
            settings.negative_prompt,
            do_classifier_free_guidance=with_negative,
            num_images_per_prompt=1,
            device=pipe._execution_device,
        )
        return paired_embeddings(with_negative, prompt_embeds=(positive, negative))

    def decode(self, pipe, latents, settings, generator):
        # Copied from CogView4Pipeline.__call__ after its denoising loop.
        latents = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor
        image = pipe.vae.decode(latents, return_dict=False, generator=generator)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
