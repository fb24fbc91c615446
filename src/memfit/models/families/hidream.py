"""HiDreamImagePipeline (CLIP-L and CLIP-G pooled, T5 and Llama-3.1 text encoders, HiDream MoE DiT).

The embeddings are the pipeline's own keyword arguments: pooled_prompt_embeds (both CLIP
projections), prompt_embeds_t5 [B, L, D] and prompt_embeds_llama3 [layers, B, L, D] (the
hidden states of every Llama layer), and their negative_ counterparts.

Like SD, HiDream batches the unconditional and conditional passes into one transformer call
(torch.cat of negative and positive embeddings), and its check_inputs refuses embeddings of
different shapes. Its transformer takes no text mask, so padding cannot be masked: memfit runs the
two passes separately, as StableDiffusionAdapter does for the UNet: it pads the shorter T5 and
Llama embeddings (text_sequences) so the pipeline's check and torch.cat pass, and
`split_guidance_passes` swaps in a transformer forward that cuts each half back to its true lengths
and calls the transformer once per half. With equal lengths nothing is changed, so the pipeline's
own batched path runs.

Size: HiDreamImagePipeline rescales every requested size to the area of its default size,
(128 x VAE scale)^2 (1024 x 1024 for the released models), keeping the aspect ratio. memfit passes
the requested width and height on unchanged, as a plain call does, so the image has the pipeline's
size; Settings (and the activation estimates) keep the requested one.
"""

from __future__ import annotations

import torch

from memfit.models.families.base import PipelineAdapter, paired_embeddings, replaced_forward



def split_guidance_passes(transformer: torch.nn.Module, lengths: dict[str, tuple[int, int]]):
    """While active, a batched [uncond, cond] transformer call runs as two calls on unpadded embeddings.

    lengths: {"prompt_embeds_t5": (negative, positive), "prompt_embeds_llama3": (negative, positive)}.
    """
    original_forward = transformer.forward

    def forward(hidden_states, timesteps=None, encoder_hidden_states_t5=None, encoder_hidden_states_llama3=None,
                pooled_embeds=None, *args, **kwargs):
        if hidden_states.shape[0] != 2:
            return original_forward(hidden_states, timesteps, encoder_hidden_states_t5, encoder_hidden_states_llama3,
                                    pooled_embeds, *args, **kwargs)
        outputs = []
        for row in (0, 1):
            rows = slice(row, row + 1)
            t5_length = lengths["prompt_embeds_t5"][row]
            llama_length = lengths["prompt_embeds_llama3"][row]
            step = timesteps[rows] if torch.is_tensor(timesteps) and timesteps.ndim > 0 else timesteps
            outputs.append(
                original_forward(
                    hidden_states[rows],
                    step,
                    encoder_hidden_states_t5[rows, :t5_length],
                    encoder_hidden_states_llama3[:, rows, :llama_length],
                    pooled_embeds[rows],
                    *args,
                    **{**kwargs, "return_dict": False},
                )[0]
            )
        return (torch.cat(outputs),)

    return replaced_forward(transformer, forward)


class HiDreamImageAdapter(PipelineAdapter):
    class_name = "HiDreamImagePipeline"
    takes_lora = True
    encode_components = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4",
                         "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4",
                     "tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")
    unequal_lengths = "split guidance passes (two transformer calls, each on its unpadded T5 and Llama embeddings)"
    max_text_tokens = 128 * 2
    splits_guidance = True
    # Llama's hidden states are stacked per layer in front of the batch.
    text_sequences = (("prompt_embeds_t5", 1), ("prompt_embeds_llama3", 2))

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * 2  # the VAE's and the transformer's 2x2 patches (image_processor)

    def default_size(self) -> int:
        return 128 * self.vae_scale_factor()  # HiDreamImagePipeline.default_sample_size

    def encode(self, pipe, settings, with_negative):
        t5, negative_t5, llama, negative_llama, pooled, negative_pooled = pipe.encode_prompt(
            prompt=settings.prompt,
            device=pipe._execution_device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=with_negative,
            negative_prompt=settings.negative_prompt,
            max_sequence_length=self.call_defaults()["max_sequence_length"],
        )
        return paired_embeddings(with_negative, prompt_embeds_t5=(t5, negative_t5),
                                 prompt_embeds_llama3=(llama, negative_llama),
                                 pooled_prompt_embeds=(pooled, negative_pooled))

    def split_passes(self, pipe, lengths):
        return split_guidance_passes(pipe.transformer, lengths)

    def decode(self, pipe, latents, settings, generator):
        # Copied from HiDreamImagePipeline.__call__ after its denoising loop.
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
