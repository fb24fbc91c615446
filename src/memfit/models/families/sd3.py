"""StableDiffusion3Pipeline (CLIP-L, CLIP-G and T5 text encoders, SD3 MMDiT transformer).

The prompt embedding is the two CLIP embeddings (77 tokens) followed by T5's (256 tokens by
default); the pooled embedding is both CLIP projections. Like SD, the pipeline batches the
unconditional and conditional passes into one transformer call (torch.cat of negative and
positive embeddings), which cannot take embeddings of different lengths, and its check_inputs
refuses them. memfit then runs the two passes separately, as StableDiffusionAdapter does for the
UNet: `split_guidance_passes` pads the shorter embedding so the pipeline's check and torch.cat pass,
and swaps in a transformer forward that cuts each half back to its true length and calls the
transformer once per half. With equal lengths nothing is changed, so the pipeline's own batched
path runs. The SD3 transformer takes no text attention mask, so padding could not be masked instead.
"""

from __future__ import annotations

import contextlib

import torch

from memfit.models.families.base import PipelineAdapter, pad_to_length


@contextlib.contextmanager
def split_guidance_passes(transformer: torch.nn.Module, negative_length: int, positive_length: int):
    """While active, a batched [uncond, cond] transformer call runs as two calls on unpadded embeddings."""
    original_forward = transformer.forward
    instance_forward = vars(transformer).get("forward")

    def forward(hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None, *args, **kwargs):
        if hidden_states.shape[0] != 2:  # not the guidance batch (e.g. a skip-layer pass): as the pipeline calls it
            return original_forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, *args, **kwargs)
        outputs = []
        for row, length in ((0, negative_length), (1, positive_length)):
            rows = slice(row, row + 1)
            step = timestep[rows] if torch.is_tensor(timestep) and timestep.ndim > 0 else timestep
            outputs.append(
                original_forward(
                    hidden_states[rows],
                    encoder_hidden_states[rows, :length],
                    pooled_projections[rows],
                    step,
                    *args,
                    **{**kwargs, "return_dict": False},
                )[0]
            )
        return (torch.cat(outputs),)

    transformer.forward = forward
    try:
        yield
    finally:
        if instance_forward is None:
            del transformer.forward
        else:
            transformer.forward = instance_forward


class StableDiffusion3Adapter(PipelineAdapter):
    class_name = "StableDiffusion3Pipeline"
    encode_components = ("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2", "text_encoder_3")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")
    unequal_lengths = "split guidance passes (two transformer calls, each on its unpadded embeddings)"
    max_text_tokens = 77 + 256
    splits_guidance = True

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * self.configs["transformer"].get("patch_size", 2)

    def default_size(self) -> int:
        return self.configs["transformer"]["sample_size"] * self.vae_scale_factor()

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
        embeddings = {"prompt_embeds": positive, "pooled_prompt_embeds": pooled}
        if with_negative:
            embeddings["negative_prompt_embeds"] = negative
            embeddings["negative_pooled_prompt_embeds"] = negative_pooled
        return embeddings

    def denoise(self, pipe, embeddings, settings, generator, split=False):
        guided = self.uses_guidance(settings.guidance)
        positive = embeddings["prompt_embeds"]
        negative = embeddings.get("negative_prompt_embeds")
        if not guided or negative is None or (negative.shape[1] == positive.shape[1] and not split):
            return super().denoise(pipe, embeddings, settings, generator)
        length = max(positive.shape[1], negative.shape[1])
        padded = dict(embeddings)
        padded["prompt_embeds"] = pad_to_length(positive, length)
        padded["negative_prompt_embeds"] = pad_to_length(negative, length)
        with split_guidance_passes(pipe.transformer, negative.shape[1], positive.shape[1]):
            return super().denoise(pipe, padded, settings, generator)

    def decode(self, pipe, latents, generator):
        # Copied from StableDiffusion3Pipeline.__call__ after its denoising loop.
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
