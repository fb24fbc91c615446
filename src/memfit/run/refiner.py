"""SDXL base + refiner, staged: the "ensemble of expert denoisers" workflow diffusers documents.

    memfit generate --model BASE --refiner REFINER [--refiner-start 0.8]
    memfit.generate(prompt, model=BASE, refiner=REFINER, refiner_start=0.8)

is, image for image, what diffusers' documentation writes as

    base = StableDiffusionXLPipeline.from_pretrained(BASE)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pretrained(
        REFINER, text_encoder_2=base.text_encoder_2, vae=base.vae)
    latents = base(prompt, num_inference_steps=n, denoising_end=0.8, output_type="latent").images
    image = refiner(prompt, num_inference_steps=n, denoising_start=0.8, image=latents).images[0]

(one generator, seeded once, threads through both calls), run as memfit stages so that only one
stage's weights are resident at a time:

    encode   the base's text encoders, then the refiner's own encode (its text_encoder_2)
    denoise  the base UNet, steps [0, refiner_start)  -> latents
    refine   the refiner UNet, steps [refiner_start, 1] on those latents (no noise added)
    decode   the VAE, once

Shared components. A refiner ships the base's VAE and second text encoder. Sharing is decided by
*content*, never by part names: a refiner component whose folder has the same fingerprint as the
base's is the same component. In the encode stage the base's loaded text_encoder_2 object is handed
to the refiner pipeline instead of loading a second copy, so it is loaded once and its compiled
entry point (memfit.compile.entry_points) is reused ("shared" in the report), not compiled again. The compile
cache and the prompt cache are keyed by content too, so a shared component maps to one cache entry
whichever pipeline asks for it. Only the refiner decodes, so the VAE is
loaded and compiled once by construction.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.run.report import RunReport
from memfit.run.options import RunOptions
from memfit.run.runner import StageRunner
from memfit.run.stages import (Generation, decode_stage, denoise_stage, encode_stage, open_model, png_metadata,
                               source_notes)

__all__ = ["DEFAULT_REFINER_START", "generate_with_refiner"]

DEFAULT_REFINER_START = 0.8  # diffusers' documented high_noise_frac
BASE_CLASS = "StableDiffusionXLPipeline"
REFINER_CLASS = "StableDiffusionXLImg2ImgPipeline"


def _check_pair(base: ModelFolder, refiner: ModelFolder, refiner_start: float) -> None:
    if base.class_name != BASE_CLASS:
        raise MemfitError(
            f"--refiner needs an SDXL base model ({BASE_CLASS}), but {base.path} is a {base.class_name}."
        )
    if refiner.class_name != REFINER_CLASS:
        raise MemfitError(
            f"--refiner {refiner.path} is a {refiner.class_name}; an SDXL refiner is a {REFINER_CLASS} "
            "(e.g. stable-diffusion-xl-refiner-1.0)."
        )
    if not 0.0 < float(refiner_start) < 1.0:
        raise MemfitError(
            f"--refiner-start must be between 0 and 1 (the fraction of denoising the base does), got {refiner_start}; "
            f"diffusers' documented value is {DEFAULT_REFINER_START}."
        )


def _refiner_model(refiner: str | Path | ModelFolder, config: str | Path | None, allow_pickle: bool):
    """The refiner as given, or a refiner checkpoint file opened with its configs (--refiner-config)."""
    from memfit.models.locate import is_single_file
    from memfit.models.single_file import SingleFileModel

    if isinstance(refiner, ModelFolder):
        return refiner
    if is_single_file(refiner):
        return SingleFileModel.open_file(refiner, config=config, allow_pickle=allow_pickle, config_flag="--refiner-config")
    if config is not None:
        raise MemfitError(f"--refiner-config is for a refiner checkpoint file, but {refiner} is a diffusers model folder, "
                          "which holds its own configs; leave --refiner-config out.")
    return refiner


def generate_with_refiner(
    prompt: str | None,
    options: RunOptions,
    *,
    model: str | Path | ModelFolder | None,
    refiner: str | Path | ModelFolder,
    refiner_config: str | Path | None = None,
    refiner_start: float = DEFAULT_REFINER_START,
    negative_prompt: str | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    width: int | None = None,
    height: int | None = None,
) -> Generation:
    """Base then refiner, staged (see the module doc), with the run's ``options`` (memfit.generate builds them).
    The prompt and settings as memfit.generate's, plus the refiner (a folder, or a checkpoint file with its
    configs from `refiner_config` or found as a model's are) and the fraction of the denoising schedule the
    base runs (`refiner_start`)."""
    if model is None:
        raise MemfitError("--refiner needs an SDXL base model: pass --model BASE as well.")
    base = open_model(model, allow_pickle=options.allow_pickle)
    ref = open_model(_refiner_model(refiner, refiner_config, options.allow_pickle), allow_pickle=options.allow_pickle)
    _check_pair(base, ref, refiner_start)
    refiner_start = float(refiner_start)
    settings = base.adapter.resolve(prompt, negative_prompt, steps, guidance, seed, width, height, base.defaults)
    guided = base.adapter.uses_guidance(settings.guidance)
    report = RunReport(device=str(options.device), dtype=options.dtype, model=str(base.path),
                       settings={**settings.__dict__, "refiner": str(ref.path), "refiner_start": refiner_start},
                       notes=[*source_notes(base), *(f"refiner {note}" for note in source_notes(ref))])
    runner = StageRunner(options, report=report, settings=settings, guided=guided)
    # One generator through both denoising calls, as in diffusers' documented workflow.
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)

    def base_run(adapter, pipe, embeddings, results, split):
        return adapter.denoise(pipe, embeddings, settings, generator, split=split,
                               inputs={"denoising_end": refiner_start})

    def refiner_run(adapter, pipe, embeddings, results, split):
        return adapter.refine(pipe, embeddings, settings, results.pop("denoise"), refiner_start, generator, split=split)

    images = runner.run([
        encode_stage([("base", base), ("refiner", ref)], settings, with_negative=guided),
        denoise_stage(base, settings, lambda results: results["encode"].pop("base"), generator, run=base_run),
        denoise_stage(ref, settings, lambda results: results.pop("encode")["refiner"], generator, name="refine",
                      run=refiner_run, label="refiner."),
        decode_stage(ref, settings, generator, latents_from="refine"),
    ])["decode"]
    metadata = png_metadata(settings, base, options.dtype)
    metadata.update(refiner=str(ref.path), refiner_start=str(refiner_start))
    return Generation(images, settings, report, metadata, timeline=runner.timeline)
