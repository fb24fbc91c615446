"""memfit.generate and memfit.encode: staged generation as lists of stages for the one runner.

generate is encode -> denoise -> decode (memfit.run.stages), or with a refiner the base + refiner
workflow (memfit.run.refiner); encode is the encode stage alone. memfit.run.runner loads, fits,
runs and releases each stage, so peak memory is the largest stage, and the image equals plain
diffusers'.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.run.embeddings import Embeddings
from memfit.run.memory import collects_only_its_own_garbage
from memfit.run.report import RunReport
from memfit.run.runner import StageRunner, default_device
from memfit.run.stages import (
    Generation,
    check_embeddings,
    decode_stage,
    denoise_stage,
    encode_stage,
    open_model,
    png_metadata,
)

__all__ = ["Generation", "encode", "generate"]


@collects_only_its_own_garbage
def encode(
    prompt: str,
    *,
    model: str | Path | None = None,
    negative_prompt: str | None = None,
    dtype: str = "fp32",
    device: str | torch.device | None = None,
    budget="auto",
    backend=None,
    fallback: str | None = None,
) -> tuple[Embeddings, RunReport]:
    """Run only the encode stage; the embeddings carry both guidance branches."""
    folder = open_model(model)
    device = torch.device(device) if device is not None else default_device()
    settings = folder.adapter.resolve(prompt, negative_prompt, 1, None, 0, None, None, folder.defaults)
    report = RunReport(device=str(device), dtype=dtype, model=str(folder.path))
    runner = StageRunner(report=report, settings=settings, guided=True, dtype=dtype, device=device, budget=budget,
                         backend=backend, fallback=fallback, progress=False)
    tensors = runner.run([encode_stage([("base", folder)], settings, with_negative=True)])["encode"]["base"]
    embeddings = Embeddings(tensors, folder.class_name, folder.text_fingerprint, settings.prompt, settings.negative_prompt)
    return embeddings, report


@collects_only_its_own_garbage
def generate(
    prompt: str | None = None,
    *,
    model: str | Path | None = None,
    embeddings: str | Path | Embeddings | None = None,
    negative_prompt: str | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    width: int | None = None,
    height: int | None = None,
    dtype: str = "fp32",
    device: str | torch.device | None = None,
    budget="auto",
    backend=None,
    fallback: str | None = None,
    progress: bool = True,
    refiner: str | Path | None = None,
    refiner_start: float | None = None,
    true_cfg_scale: float | None = None,
    num_frames: int | None = None,
) -> Generation:
    """Generate an image with a diffusers model folder, one stage resident at a time.

    `model` defaults to memfit's built-in demo model. With `embeddings` (a file from
    `memfit encode` or an Embeddings object) the encode stage is skipped entirely. `budget`
    ("auto", the default: what this machine, container or GPU can spare now; "none": no planning;
    bytes, "2GiB", or a Budget) bounds each stage's peak: the process's own memory, resident
    weights, streamed blocks in flight and activations. Blocks that do not fit are streamed
    (memfit.optimize); activations are bounded by an exact strategy where needed (banded VAE
    decode, split guidance passes: memfit.plan.activations). The report shows each stage's planned
    peak and strategy; its notes show the plan. `backend` (a name,
    a Backend, or {component: backend}) compiles each stage's entry points after loading
    (memfit.compile.entry_points); a backend failure raises unless `fallback="eager"`, and the report says so.
    `refiner` (an SDXL refiner folder) runs diffusers' base + refiner workflow: the base stops at
    `refiner_start` (default 0.8) of the schedule and the refiner finishes (memfit.run.refiner).
    """
    if refiner is not None:
        from memfit.run.refiner import DEFAULT_REFINER_START, generate_with_refiner

        if embeddings is not None:
            raise MemfitError("--embeddings cannot be combined with --refiner yet: the refiner needs its own encode; pass --prompt.")
        return generate_with_refiner(
            prompt, model=model, refiner=refiner,
            refiner_start=DEFAULT_REFINER_START if refiner_start is None else refiner_start,
            negative_prompt=negative_prompt, steps=steps, guidance=guidance, seed=seed, width=width, height=height,
            dtype=dtype, device=device, budget=budget, backend=backend, fallback=fallback, progress=progress,
        )
    if refiner_start is not None:
        raise MemfitError("--refiner-start only applies with --refiner REFINER.")
    folder = open_model(model)
    adapter = folder.adapter
    device = torch.device(device) if device is not None else default_device()

    loaded = None
    if embeddings is not None:
        if prompt is not None or negative_prompt is not None:
            raise MemfitError("Pass either a prompt or an embeddings file, not both: the embeddings already fix the prompt.")
        loaded = embeddings if isinstance(embeddings, Embeddings) else Embeddings.load(embeddings)
        check_embeddings(loaded, folder, "The embeddings" if isinstance(embeddings, Embeddings) else str(embeddings))
        prompt, negative_prompt = loaded.prompt, loaded.negative_prompt
    settings = adapter.resolve(prompt, negative_prompt, steps, guidance, seed, width, height, folder.defaults,
                               true_cfg_scale=true_cfg_scale, num_frames=num_frames)
    guided = adapter.guided(settings)
    report = RunReport(device=str(device), dtype=dtype, model=str(folder.path), settings=settings.__dict__.copy())
    runner = StageRunner(report=report, settings=settings, guided=guided, dtype=dtype, device=device, budget=budget,
                         backend=backend, fallback=fallback, progress=progress)

    stages = []
    if loaded is None:
        stages.append(encode_stage([("base", folder)], settings, with_negative=guided))
    else:
        if guided and not loaded.has_negative:
            raise MemfitError("These embeddings have no negative prompt branch; generate with --guidance 1 or encode again.")
        report.notes.append("encode stage skipped: embeddings loaded from file")

    def prompt_embeddings(results):
        tensors = results.pop("encode")["base"] if loaded is None else {
            name: t.to(device) for name, t in loaded.tensors.items()}
        negative = tensors.get("negative_prompt_embeds") if guided else None
        if negative is not None and negative.shape[1] != tensors["prompt_embeds"].shape[1]:
            report.notes.append(
                f"prompt embeddings of lengths {tensors['prompt_embeds'].shape[1]} (positive) and {negative.shape[1]} "
                f"(negative): {adapter.unequal_lengths}"
            )
        return tensors

    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    stages += [denoise_stage(folder, settings, prompt_embeddings, generator), decode_stage(folder, settings, generator)]
    images = runner.run(stages)["decode"]
    return Generation(images, settings, report, png_metadata(settings, folder, dtype), timeline=runner.timeline)
