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
whichever pipeline asks for it (DESIGN.md failure 4). Only the refiner decodes, so the VAE is
loaded and compiled once by construction.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.cache.fingerprint import fingerprint_folder
from memfit.models.folder import ModelFolder, parse_dtype
from memfit.run.report import RunReport
from memfit.run.generate import (
    Generation,
    _default_device,
    _load_stage,
    _open_model,
    _png_metadata,
    _present,
    _resident_bytes,
    _run_stage,
    text_fingerprint,
)

__all__ = ["DEFAULT_REFINER_START", "generate_with_refiner", "shared_components"]

DEFAULT_REFINER_START = 0.8  # diffusers' documented high_noise_frac
BASE_CLASS = "StableDiffusionXLPipeline"
REFINER_CLASS = "StableDiffusionXLImg2ImgPipeline"


class _CallWith:
    """A pipeline whose __call__ gets extra keyword arguments (the base's denoising_end), so the
    base adapter's own denoise code runs unchanged; every attribute is the pipeline's."""

    def __init__(self, pipe, **kwargs):
        self._pipe = pipe
        self._kwargs = kwargs

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def __call__(self, *args, **kwargs):
        return self._pipe(*args, **kwargs, **self._kwargs)


def shared_components(base: ModelFolder, refiner: ModelFolder, names=None) -> list[str]:
    """Component names present in both folders with identical content (same folder fingerprint)."""
    candidates = sorted(set(base.components) & set(refiner.components))
    if names is not None:
        candidates = [name for name in candidates if name in names]
    return [
        name for name in candidates
        if (base.path / name).is_dir() and (refiner.path / name).is_dir()
        and fingerprint_folder(base.path / name) == fingerprint_folder(refiner.path / name)
    ]


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


def _encode_stage(base, refiner, settings, report, dtype, device, guided, budget, backend, fallback):
    """Both pipelines' prompt embeddings in one stage; a shared text encoder is loaded once."""
    from memfit.compile.entry_points import compile_stage
    from memfit.run.prompt_cache import PromptCache, embeddings_key, text_backend_label

    folders = {"base": base, "refiner": refiner}
    names = {role: _present(folder, folder.adapter.encode_components) for role, folder in folders.items()}
    caches = {
        role: PromptCache(embeddings_key(text_fingerprint(folder), folder.class_name, settings.prompt,
                                         settings.negative_prompt, guided, dtype,
                                         text_backend_label(backend, names[role])))
        for role, folder in folders.items()
    }
    found = {role: cache.lookup() for role, cache in caches.items()}  # a hit loads no text encoder
    shared = shared_components(base, refiner, names["refiner"]) if found["base"] is None and found["refiner"] is None else []
    compiled: list = []
    resident: list[str] = []

    def work():
        tensors, weights, base_pipe = {}, 0, None
        for role in ("base", "refiner"):
            folder = folders[role]
            if found[role] is not None:
                tensors[role] = {k: v.to(device) for k, v in found[role].items()}
                continue
            reuse = {name: getattr(base_pipe, name) for name in shared} if role == "refiner" else {}
            load = [name for name in names[role] if name not in reuse]
            # With its text encoder shared, the refiner's encode loads only a tokenizer: nothing to plan.
            weighted = any(not name.startswith(("tokenizer", "scheduler")) for name in load)
            pipe = _load_stage(folder, load, dtype, device, budget if weighted else None, report)
            if reuse:
                pipe.register_modules(**reuse)  # the base's objects: loaded (and compiled) once
            compile_stage(pipe, folder.path, backend, fallback, compiled)
            with torch.inference_mode():
                embeddings = folder.adapter.encode(pipe, settings, guided)
            tensors[role] = {k: v.clone() for k, v in embeddings.items()}
            weights += _resident_bytes(pipe, load)
            resident.extend(f"{name}" if role == "base" else f"refiner.{name}" for name in load)
            if role == "base":
                base_pipe = pipe
        return tensors, weights

    tensors = _run_stage(report, device, "encode", [], work, compiled)
    report.stages[-1].components = resident
    hits = [role for role in folders if found[role] is not None]
    if hits:
        report.stages[-1].note = f"cache hit ({', '.join(hits)})"
    if shared:
        report.notes.append(f"encode: refiner shares {', '.join(shared)} with the base (same content): loaded once")
    for role, cache in caches.items():
        if found[role] is None:
            folder = folders[role]
            cache.save(tensors[role], folder.class_name, text_fingerprint(folder), settings.prompt, settings.negative_prompt)
    return tensors["base"], tensors["refiner"]


def generate_with_refiner(
    prompt: str | None,
    *,
    model: str | Path | ModelFolder | None,
    refiner: str | Path | ModelFolder,
    refiner_start: float = DEFAULT_REFINER_START,
    negative_prompt: str | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    width: int | None = None,
    height: int | None = None,
    dtype: str = "fp32",
    device: str | torch.device | None = None,
    budget=None,
    backend=None,
    fallback: str | None = None,
    progress: bool = True,
) -> Generation:
    """Base then refiner, staged (see the module doc). Same arguments as memfit.generate, plus the
    refiner folder and the fraction of the denoising schedule the base runs (`refiner_start`)."""
    from memfit.compile.entry_points import compile_stage

    if model is None:
        raise MemfitError("--refiner needs an SDXL base model: pass --model BASE as well.")
    base = _open_model(model)
    ref = _open_model(refiner)
    _check_pair(base, ref, refiner_start)
    refiner_start = float(refiner_start)
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device) if device is not None else _default_device()
    settings = base.adapter.resolve(prompt, negative_prompt, steps, guidance, seed, width, height, base.defaults)
    guided = base.adapter.uses_guidance(settings.guidance)
    report = RunReport(device=str(device), dtype=dtype, model=str(base.path),
                       settings={**settings.__dict__, "refiner": str(ref.path), "refiner_start": refiner_start})

    base_tensors, ref_tensors = _encode_stage(base, ref, settings, report, torch_dtype, device, guided, budget,
                                              backend, fallback)
    # One generator through both denoising calls, as in diffusers' documented workflow.
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)

    def stage(folder: ModelFolder, names, run):
        compiled: list = []

        def work():
            pipe = _load_stage(folder, names, torch_dtype, device, budget, report)
            compile_stage(pipe, folder.path, backend, fallback, compiled)
            pipe.set_progress_bar_config(disable=not progress, leave=False)
            with torch.inference_mode():
                out = run(pipe)
            return out, _resident_bytes(pipe, names)

        return work, compiled

    base_names = _present(base, base.adapter.denoise_components)
    work, compiled = stage(base, base_names, lambda pipe: base.adapter.denoise(
        _CallWith(pipe, denoising_end=refiner_start), base_tensors, settings, generator).clone())
    latents = _run_stage(report, device, "denoise", base_names, work, compiled)
    del base_tensors

    ref_names = _present(ref, ref.adapter.denoise_components)
    work, compiled = stage(ref, ref_names, lambda pipe: ref.adapter.refine(
        pipe, ref_tensors, settings, latents, refiner_start, generator).clone())
    latents = _run_stage(report, device, "refine", [f"refiner.{name}" for name in ref_names], work, compiled)
    del ref_tensors

    decode_names = _present(ref, ref.adapter.decode_components)
    work, compiled = stage(ref, decode_names, lambda pipe: ref.adapter.decode(pipe, latents, generator))
    images = _run_stage(report, device, "decode", decode_names, work, compiled)

    metadata = _png_metadata(settings, base, dtype)
    metadata.update(refiner=str(ref.path), refiner_start=str(refiner_start))
    return Generation(images, settings, report, metadata)
