"""HunyuanImagePipeline (HunyuanImage 2.1): a Qwen2.5-VL text encoder, a ByT5 (T5 encoder) for the
quoted text of a prompt, the HunyuanImage MMDiT transformer and its 32x VAE.

Encoding: the pipeline's own encode_prompt gives four tensors per prompt: the Qwen2.5-VL embeddings
and mask (prompt_embeds, prompt_embeds_mask) and the ByT5 glyph embeddings and mask (prompt_embeds_2,
prompt_embeds_mask_2). A prompt without quoted text gets zero glyph embeddings; text_encoder_2 is
loaded in the encode stage all the same, since encode_prompt reads its width from it.

Guidance is not a __call__ argument here but a component: `guider` (an AdaptiveProjectedMixGuidance,
CFG then adaptive projected guidance) and `ocr_guider`, which the pipeline runs instead when the
glyph embeddings are not all zero. memfit's guidance is the guiders' guidance_scale: its default is
`guider`'s own, and at that default both guiders run exactly as the folder configures them; any
other value replaces guidance_scale in both for the run. A folder with neither guider (a distilled
model) runs without negative prompt. As in diffusers, a missing negative prompt is the empty one.

Unequal lengths: native. The guider runs the conditional and unconditional passes as separate
transformer calls, each with its own embeddings and masks, and check_inputs compares no shapes
(encode_prompt pads both encoders to fixed lengths anyway: 1000 and 128 tokens).

Latents are not packed (the transformer's patch size is 1): the denoise stage hands over the
pipeline's latents as they are, and decode copies the pipeline's post-loop code.
"""

from __future__ import annotations

import inspect
import math

from memfit.errors import MemfitError
from memfit.models.families.base import PipelineAdapter

GUIDERS = ("guider", "ocr_guider")


class HunyuanImageAdapter(PipelineAdapter):
    class_name = "HunyuanImagePipeline"
    encode_components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    denoise_components = ("transformer", "scheduler", *GUIDERS)
    text_encoders = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    unequal_lengths = "native: the guider runs the two guidance passes separately, each with its own masks"
    max_text_tokens = 1000 + 128  # the Qwen2.5-VL tokens and the ByT5 glyph tokens, side by side
    guidance_batch = 1  # the negative pass is a separate transformer call
    separate_guidance_passes = True
    text_sequences = (("prompt_embeds", 1), ("prompt_embeds_2", 1))
    per_prompt_keyword = "num_images_per_prompt"  # what its encode_prompt calls the outputs per prompt

    # ---- settings ----------------------------------------------------------------------------
    def guider_config(self, name: str) -> dict | None:
        """The settings of guider ``name`` (its guider_config.json over its class's defaults), None without one."""
        if name not in self.classes and name not in self.configs:
            return None
        import diffusers

        class_name = self.classes.get(name, ("", ""))[1] or self.configs.get(name, {}).get("_class_name", "")
        guider_class = getattr(diffusers, class_name, None)
        defaults = {} if guider_class is None else {
            key: p.default for key, p in inspect.signature(guider_class.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}
        return {**defaults, **{k: v for k, v in self.configs.get(name, {}).items() if not k.startswith("_")}}

    def default_guidance(self) -> float:
        """The guidance of a run without --guidance: `guider`'s scale (`ocr_guider`'s without one), else
        1 (none: a distilled model)."""
        for name in GUIDERS:
            config = self.guider_config(name)
            if config is not None:
                return float(config.get("guidance_scale", 1.0))
        return 1.0

    def call_defaults(self):
        defaults = super().call_defaults()
        defaults["guidance_scale"] = self.default_guidance()  # memfit's guidance is the guiders' scale
        return defaults

    def guider_scales(self, guidance: float) -> dict[str, float]:
        """{guider: the guidance_scale it runs with} for a run at ``guidance`` (see the module doc)."""
        overridden = not math.isclose(guidance, self.default_guidance())
        scales = {}
        for name in GUIDERS:
            config = self.guider_config(name)
            if config is not None:
                scales[name] = float(guidance if overridden else config.get("guidance_scale", 1.0))
        return scales

    def uses_guidance(self, guidance: float) -> bool:
        # As AdaptiveProjectedMixGuidance._is_cfg_enabled: an enabled guider whose scale is not the
        # neutral one (1, or 0 in the original formulation) runs an unconditional pass.
        for name, scale in self.guider_scales(guidance).items():
            config = self.guider_config(name)
            neutral = 0.0 if config.get("use_original_formulation") else 1.0
            if config.get("enabled", True) and not math.isclose(scale, neutral):
                return True
        return False

    def guided(self, settings) -> bool:
        return self.uses_guidance(settings.guidance)

    def vae_scale_factor(self) -> int:
        return int(self.configs["vae"]["spatial_compression_ratio"])

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * 2  # the pipeline's check_inputs asks for twice the VAE's scale

    def default_size(self) -> int:
        return 64 * self.vae_scale_factor()  # the pipeline's default_sample_size

    def call_kwargs(self, settings):
        return dict(num_inference_steps=settings.steps, height=settings.height, width=settings.width)

    # ---- stages ------------------------------------------------------------------------------
    def encode(self, pipe, settings, with_negative):
        device = pipe._execution_device
        embeddings = {}
        prompts = [("", settings.prompt)] + ([("negative_", settings.negative_prompt or "")] if with_negative else [])
        for prefix, prompt in prompts:
            embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=prompt, device=device, batch_size=1,
                                                                **{self.per_prompt_keyword: 1})
            embeddings.update({f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": mask,
                               f"{prefix}prompt_embeds_2": embeds_2, f"{prefix}prompt_embeds_mask_2": mask_2})
        return embeddings

    def embedding_kwargs(self, embeddings, guided):
        positives = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        missing = [name for name in positives if name not in embeddings]
        if missing:
            raise MemfitError(
                f"{self.class_name} needs {', '.join(positives)}, but {', '.join(missing)} is missing from the embeddings; "
                "re-encode the prompt with memfit encode."
            )
        if not guided:
            return {name: value for name, value in embeddings.items() if not name.startswith("negative_")}
        missing = [f"negative_{name}" for name in positives if f"negative_{name}" not in embeddings]
        if missing:
            raise MemfitError(
                f"Guidance needs negative prompt embeddings, but {', '.join(missing)} is missing; re-encode with "
                "memfit encode, or pass --guidance 1 to generate without guidance."
            )
        return dict(embeddings)

    def call_components(self, pipe, settings):
        # The pipeline's guiders, each rebuilt at the scale this run gives it (guider_scales) where that differs.
        scales = self.guider_scales(settings.guidance)
        rebuilt = {}
        for name in GUIDERS:
            guider = getattr(pipe, name, None)
            if guider is not None and name in scales and not math.isclose(guider.guidance_scale, scales[name]):
                rebuilt[name] = guider.new(guidance_scale=scales[name])
        return rebuilt

    def denoise_call(self, pipe, embeddings, settings, generator, **inputs):
        own = {name: getattr(pipe, name, None) for name in GUIDERS}
        try:
            for name, guider in self.call_components(pipe, settings).items():
                setattr(pipe, name, guider)
            return super().denoise_call(pipe, embeddings, settings, generator, **inputs)
        finally:  # a warm stage's pipeline is reused: its own guiders are back for the next run
            for name, guider in own.items():
                if getattr(pipe, name, None) is not guider:
                    setattr(pipe, name, guider)

    def decode(self, pipe, latents, settings, generator):
        # Copied from HunyuanImagePipeline.__call__ after its denoising loop.
        latents = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")
