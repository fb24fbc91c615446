"""StableDiffusionPipeline and StableDiffusionXLPipeline.

Both batch the unconditional and conditional passes into one UNet call (torch.cat of negative and
positive embeddings), which cannot take embeddings of different lengths. memfit then runs the two
passes separately (PipelineAdapter.denoise): it pads the shorter embedding so the pipeline's
torch.cat works, and `split_guidance_passes` swaps in a UNet forward that cuts each half back to
its true length and calls the UNet once per half. With equal lengths nothing is changed, so the
pipeline's own batched path runs.
"""

from __future__ import annotations

import torch

from memfit.models.families.base import PipelineAdapter, Settings, paired_embeddings, replaced_forward


def split_guidance_passes(unet: torch.nn.Module, negative_length: int, positive_length: int):
    """While active, a batched [uncond, cond] UNet call runs as two calls on unpadded embeddings."""
    original_forward = unet.forward

    def forward(sample, timestep, encoder_hidden_states, *args, added_cond_kwargs=None, **kwargs):
        half = sample.shape[0] // 2
        outputs = []
        for rows, length in ((slice(0, half), negative_length), (slice(half, None), positive_length)):
            added = None
            if added_cond_kwargs is not None:
                added = {key: value[rows] for key, value in added_cond_kwargs.items()}
            step = timestep[rows] if torch.is_tensor(timestep) and timestep.ndim > 0 else timestep
            outputs.append(
                original_forward(
                    sample[rows],
                    step,
                    encoder_hidden_states[rows, :length],
                    *args,
                    added_cond_kwargs=added,
                    **{**kwargs, "return_dict": False},
                )[0]
            )
        return (torch.cat(outputs),)

    return replaced_forward(unet, forward)


class StableDiffusionAdapter(PipelineAdapter):
    class_name = "StableDiffusionPipeline"
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("unet", "scheduler")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "split guidance passes (two UNet calls, each on its unpadded embeddings)"
    splits_guidance = True
    tasks = {
        "img2img": "StableDiffusionImg2ImgPipeline",
        "inpaint": "StableDiffusionInpaintPipeline",
        "controlnet": "StableDiffusionControlNetPipeline",
        "controlnet_img2img": "StableDiffusionControlNetImg2ImgPipeline",
        "controlnet_inpaint": "StableDiffusionControlNetInpaintPipeline",
    }
    takes_lora = True

    def uses_guidance(self, guidance: float) -> bool:
        return guidance > 1 and self.configs["unet"].get("time_cond_proj_dim") is None

    def encode(self, pipe, settings: Settings, with_negative: bool) -> dict[str, torch.Tensor]:
        positive, negative = pipe.encode_prompt(
            settings.prompt,
            pipe._execution_device,
            1,
            with_negative,
            settings.negative_prompt,
        )
        return paired_embeddings(with_negative, prompt_embeds=(positive, negative))

    def split_passes(self, pipe, lengths):
        return split_guidance_passes(pipe.unet, *lengths["prompt_embeds"])

    def decode(self, pipe, latents, settings, generator):
        # Copied from StableDiffusionPipeline.__call__ after its denoising loop (no safety checker:
        # memfit loads none, as the pipeline does when the folder has none).
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False, generator=generator)[0]
        return pipe.image_processor.postprocess(image, output_type="pil", do_denormalize=[True] * image.shape[0])


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    class_name = "StableDiffusionXLPipeline"
    encode_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")
    text_encoders = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    tasks = {
        "img2img": "StableDiffusionXLImg2ImgPipeline",
        "inpaint": "StableDiffusionXLInpaintPipeline",
        "controlnet": "StableDiffusionXLControlNetPipeline",
        "controlnet_img2img": "StableDiffusionXLControlNetImg2ImgPipeline",
        "controlnet_inpaint": "StableDiffusionXLControlNetInpaintPipeline",
    }

    def encode(self, pipe, settings, with_negative):
        device = pipe._execution_device
        positive, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=settings.prompt,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=with_negative,
            negative_prompt=settings.negative_prompt,
        )
        return paired_embeddings(with_negative, prompt_embeds=(positive, negative),
                                 pooled_prompt_embeds=(pooled, negative_pooled))

    def decode(self, pipe, latents, settings, generator):
        # Copied from StableDiffusionXLPipeline.__call__ after its denoising loop.
        vae = pipe.vae
        needs_upcasting = vae.dtype == torch.float16 and vae.config.force_upcast
        if needs_upcasting:
            pipe.upcast_vae()
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        mean = getattr(vae.config, "latents_mean", None)
        std = getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents.to(vae.device), return_dict=False)[0]
        if needs_upcasting:
            vae.to(dtype=torch.float16)
        if pipe.watermark is not None:
            image = pipe.watermark.apply_watermark(image)
        return pipe.image_processor.postprocess(image, output_type="pil")
