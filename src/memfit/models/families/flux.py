"""FluxPipeline (CLIP-L pooled + T5 text encoders, MMDiT transformer), dev and schnell alike.

`guidance` is Flux's own guidance_scale: the *embedded* guidance of guidance-distilled models
(dev: transformer guidance_embeds=True; schnell ignores it). It needs no negative prompt.
True classifier-free guidance is a separate setting, `true_cfg_scale` (Settings field): as in
diffusers, it runs only when true_cfg_scale > 1 *and* a negative prompt is given, as a second,
separate transformer pass per step.

Unequal lengths: the two passes are separate calls, each with its own text ids
(zeros of its own length), so they could take different lengths, but FluxPipeline.__call__
refuses prompt/negative embeddings of different shapes. memfit pads the shorter embedding with
zeros to pass that check and, while the pipeline runs, cuts the padded tensor (and its text ids)
back to its true length inside the transformer call that receives it: each pass sees exactly its
unpadded embedding, as the pipeline's own separate passes would.

Latents are packed in 2x2 patches (memfit.models.families.packed_latents): the denoise stage
hands them over unpacked into the VAE's layout; decode copies the rest of the pipeline's post-loop code.
"""

from __future__ import annotations

import torch

from memfit.models.families.base import replaced_forward
from memfit.models.families.packed_latents import PackedLatentsAdapter


def trim_padded_text(transformer: torch.nn.Module, padded: dict[int, int]):
    """While active, a transformer call whose encoder_hidden_states is one of the padded tensors
    (keyed by id) runs on its first `length` tokens and text ids only."""
    original_forward = transformer.forward

    def forward(*args, encoder_hidden_states=None, txt_ids=None, **kwargs):
        length = padded.get(id(encoder_hidden_states))
        if length is not None:
            encoder_hidden_states = encoder_hidden_states[:, :length]
            if txt_ids is not None:
                txt_ids = txt_ids[:length] if txt_ids.ndim == 2 else txt_ids[:, :length]
        return original_forward(*args, encoder_hidden_states=encoder_hidden_states, txt_ids=txt_ids, **kwargs)

    return replaced_forward(transformer, forward)


class FluxAdapter(PackedLatentsAdapter):
    class_name = "FluxPipeline"
    takes_lora = True
    encode_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")
    denoise_components = ("transformer", "scheduler")
    text_encoders = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    unequal_lengths = "separate passes: the shorter embedding is padded for the pipeline's shape check and cut back inside its own transformer call"
    max_text_tokens = 512
    guidance_batch = 1  # true CFG runs the negative pass as a separate transformer call
    separate_guidance_passes = True
    options = ("true_cfg_scale",)

    def guided(self, settings) -> bool:
        # FluxPipeline: do_true_cfg = true_cfg_scale > 1 and has_neg_prompt.
        return settings.true_cfg_scale > 1 and settings.negative_prompt is not None

    def call_kwargs(self, settings):
        kwargs = super().call_kwargs(settings)
        if "true_cfg_scale" in self.options:  # FLUX.1 Fill's pipeline takes none
            kwargs["true_cfg_scale"] = settings.true_cfg_scale
        return kwargs

    def encode(self, pipe, settings, with_negative):
        device = pipe._execution_device
        positive, pooled, _ = pipe.encode_prompt(prompt=settings.prompt, prompt_2=None, device=device,
                                                 num_images_per_prompt=1)
        embeddings = {"prompt_embeds": positive, "pooled_prompt_embeds": pooled}
        if with_negative:
            # FluxPipeline encodes the negative prompt with the same encode_prompt call.
            negative, negative_pooled, _ = pipe.encode_prompt(prompt=settings.negative_prompt or "", prompt_2=None,
                                                              device=device, num_images_per_prompt=1)
            embeddings["negative_prompt_embeds"] = negative
            embeddings["negative_pooled_prompt_embeds"] = negative_pooled
        return embeddings

    def fit_lengths(self, pipe, embeddings, lengths):
        padded = self.pad_to_longest(embeddings, lengths)
        longest = max(lengths["prompt_embeds"])
        true_lengths = {id(padded[prefix + "prompt_embeds"]): length
                        for prefix, length in zip(("negative_", ""), lengths["prompt_embeds"]) if length < longest}
        return padded, trim_padded_text(pipe.transformer, true_lengths)

    def decode(self, pipe, latents, settings, generator):
        # Copied from FluxPipeline.__call__ after its denoising loop (_unpack_latents ran in denoise).
        from diffusers.utils.torch_utils import get_module_execution_device

        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        latents = latents.to(get_module_execution_device(pipe.vae))
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
