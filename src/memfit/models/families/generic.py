"""Any diffusers pipeline class without an adapter of its own: described from its folder alone.

Components are known by the names diffusers gives them: text encoders and tokenizers
(``text_encoder*``, ``tokenizer*``) run in the encode stage, the denoiser(s) (DENOISER_NAMES) and a
ControlNet (DENOISE_COMPANIONS) with the scheduler in the denoise stage, the ``vae`` in the decode
stage. Pipelines whose
``__call__`` takes ``true_cfg_scale`` run the negative pass as a separate call, so their denoiser
sees a batch of one; every other pipeline is taken to batch both guidance passes (the safe side
for memory).

memfit plans such a pipeline (``memfit plan --model``) and runs it (``memfit generate``) through
its own ``__call__``, in one stage: every component is loaded and fitted to the budget together,
since only the pipeline knows which runs when. Nothing is staged: no prompt cache, no embeddings
file, no strategies for activations beyond the largest of its parts'. An adapter of its own adds
those.
"""

from __future__ import annotations

from typing import Any

from memfit.models.families.base import DENOISE_COMPANIONS, DENOISER_NAMES, PipelineAdapter, Settings

# Prompts longer than this are rare; a long-context encoder (Gemma: 8192 positions) is planned at 512.
_LONGEST_PLANNED_PROMPT = 512


class GenericAdapter(PipelineAdapter):
    unequal_lengths = "not staged: the pipeline's own __call__ encodes its prompts"
    staged = False

    def __init__(self, configs, classes, class_name: str):
        super().__init__(configs, classes)
        self.class_name = class_name
        self.options = tuple(name for name in ("true_cfg_scale", "num_frames") if name in self.call_defaults())
        names = list(classes)
        self.encode_components = tuple(n for n in names if n.startswith(("tokenizer", "text_encoder")))
        self.text_encoders = self.encode_components
        # A ControlNet (DENOISE_COMPANIONS) runs every step beside the denoiser: planned with it.
        self.denoise_components = (tuple(n for n in DENOISER_NAMES + DENOISE_COMPANIONS if n in names)
                                   + tuple(n for n in names if n.startswith("scheduler")))
        self.decode_components = ("vae",) if "vae" in names else ()
        lengths = [min(int(configs[n].get("max_position_embeddings") or _LONGEST_PLANNED_PROMPT), _LONGEST_PLANNED_PROMPT)
                   for n in self.encode_components if n.startswith("text_encoder") and n in configs]
        self.max_text_tokens = max(lengths, default=77)
        self.guidance_batch = 1 if "true_cfg_scale" in self.call_defaults() else 2

    def default_size(self) -> int:
        denoiser = self.configs.get(next((n for n in self.denoise_components if n in DENOISER_NAMES), ""), {})
        # sample_size is the latent side the denoiser was trained at (128 for SDXL and Flux).
        sample = denoiser.get("sample_size") or 128
        return int(sample if isinstance(sample, int) else sample[-1]) * self.vae_scale_factor()

    def pipeline_kwargs(self, settings: Settings) -> dict[str, Any]:
        """The __call__ arguments of a whole run from the prompt, those this class's __call__ takes."""
        takes = self.call_defaults()
        kwargs = dict(prompt=settings.prompt, negative_prompt=settings.negative_prompt,
                      num_inference_steps=settings.steps, guidance_scale=settings.guidance, width=settings.width,
                      height=settings.height, true_cfg_scale=settings.true_cfg_scale,
                      num_frames=settings.num_frames if self.makes_video else None, output_type="pil")
        return {name: value for name, value in kwargs.items() if name in takes and value is not None}
