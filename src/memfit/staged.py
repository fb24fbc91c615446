"""Staged generation: encode (text encoders only), denoise (denoiser only), decode (VAE only).

Each stage loads just its components from the model folder, runs, and releases them before the
next stage loads, so peak memory is the largest stage rather than the sum of all components. Each
stage runs the pipeline's own code through its adapter, so the image equals plain diffusers'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._atomic import write_atomically
from .embeddings import Embeddings
from .errors import MemfitError
from .memory import PeakMemory, collects_only_its_own_garbage, current_rss, release_freed_memory, return_large_frees_to_os
from .model_folder import ModelFolder, parse_dtype
from .pipelines import Settings
from .compile import compile_stage
from .report import RunReport, StageReport, format_bytes


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _open_model(model: str | Path | ModelFolder | None) -> ModelFolder:
    if isinstance(model, ModelFolder):
        return model
    if model is None:
        from .demo import model_dir

        model = model_dir()
    return ModelFolder.open(model)


def _resident_bytes(pipe, names) -> int:
    total = 0
    for name in names:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            total += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return total


def _run_stage(report: RunReport, device, name: str, components, work: Callable[[], tuple[object, int]], compiled=None,
               fit: _Fit | None = None):
    release_freed_memory()
    with PeakMemory(device) as peak:
        started = time.perf_counter()
        result, weights = work()
        release_freed_memory()  # the stage's pipeline is gone once `work` returns
        seconds = time.perf_counter() - started
    report.stages.append(
        StageReport(name, list(components), seconds, peak.peak_bytes, peak.start_bytes, weights, peak.method,
                    planned_peak_bytes=fit.planned_peak if fit else None, strategy=fit.strategy if fit else "")
    )
    if compiled:
        from .compile import report_records

        report_records(report, compiled)
    return result


@dataclass
class _Fit:
    """What a stage needs to be fitted into the budget with its activations (memfit.activations)."""

    stage: str
    settings: Settings
    guided: bool
    dtype: str
    strategy: str = ""
    planned_peak: int | None = None


def _load_stage(model: ModelFolder, names, dtype, device, budget, report: RunReport, fit: _Fit | None = None):
    """Load a stage's components; with a budget, carry out a plan for them (memfit.optimize).

    With ``fit``, the stage is planned as one unit with its activations: the strategy (see
    memfit.activations) and the predicted peak are written into ``fit``.
    """
    already_used = _memory_in_use(device)
    pipe = model.load_stage(names, dtype, device)
    if budget is None:
        return pipe
    from .budget import Budget
    from .executor import PLAN_ATTR, blocks_not_run, optimize, plan_stage, reads_in_place

    budget = Budget.of(budget)
    if device.type == "cpu":
        # Host RAM is the execution device here: what does not fit stays memory-mapped from the
        # model's own safetensors files (the disk tier), never a second copy in RAM.
        budget = Budget(device=budget.device, host=0, disk=str(model.path))
    if fit is None:
        optimize(pipe, budget, model_dir=model.path, device=device)
    else:
        from .activations import choose, stage_strategies

        room = _room_left(budget, already_used)
        options = stage_strategies(model.adapter, fit.stage, fit.settings, fit.guided, fit.dtype)
        parts = model.adapter.stage_parts.get(fit.stage)
        try:
            strategy, plan = choose(options, lambda activations: plan_stage(pipe, room, fit.stage, activations, parts))
        except MemfitError as exc:
            raise MemfitError(
                f"{exc} These figures leave out the {format_bytes(already_used)} this process already holds "
                "(Python, torch and the libraries loaded): add that to any budget named above."
            ) from exc
        optimize(pipe, plan=plan, model_dir=model.path, device=device, parts=parts)
        fit.strategy = strategy.name
        unrun = blocks_not_run(pipe)
        if unrun:
            report.notes.append(
                f"{fit.stage}: {format_bytes(sum(b.bytes for b in unrun))} of weights the stage does not run "
                f"({', '.join(sorted({b.component + '/' + b.name.split('.')[0] for b in unrun}))}) left memory-mapped "
                "on disk, outside the plan"
            )
        stage_plan = plan.stages[0]
        # The plan fits the read-ahead into the budget (a cgroup cap charges the page cache), but read in
        # place it is mapped into this process only once its block runs: the predicted peak RSS leaves it out.
        read_ahead = stage_plan.stream_window_bytes - stage_plan.largest_streamed_bytes if reads_in_place(pipe) else 0
        fit.planned_peak = already_used + stage_plan.peak_bytes - read_ahead
        if read_ahead:
            report.notes.append(f"{fit.stage}: {format_bytes(read_ahead)} read ahead into the page cache, "
                                "outside this process's memory until its block runs")
        if strategy is not options[0]:
            report.notes.append(
                f"{fit.stage}: {strategy.name} (activations {format_bytes(strategy.activation_bytes)} instead of "
                f"{format_bytes(options[0].activation_bytes)} for {options[0].name}), so more weights stay resident"
            )
    for stage in getattr(pipe, PLAN_ATTR).stages:
        report.notes.append(
            f"plan {stage.name}: {stage.resident_bytes / 2**20:.0f} MiB resident, "
            f"{stage.streamed_from_host_bytes / 2**20:.0f} MiB streamed from host, "
            f"{stage.streamed_from_disk_bytes / 2**20:.0f} MiB streamed from disk (memory-mapped), "
            f"activations {stage.activation_bytes / 2**20:.0f} MiB"
        )
    return pipe


def _memory_in_use(device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return current_rss()


def _room_left(budget, already_used: int):
    """The budget left for this stage's weights and activations once the process's own memory is counted."""
    from .budget import Budget

    if budget.device is None:
        return budget
    if budget.device <= already_used:
        raise MemfitError(
            f"The budget of {format_bytes(budget.device)} is already used up by this process before any weight is "
            f"loaded ({format_bytes(already_used)}: Python, torch and the libraries memfit loaded). Give a budget "
            "above that, or none to let memfit detect one."
        )
    return Budget(device=budget.device - already_used, host=budget.host, disk=budget.disk)


def _present(model: ModelFolder, names) -> list[str]:
    return [name for name in names if name in model.components]


def text_fingerprint(model: ModelFolder) -> str:
    return model.text_fingerprint


def _encode_stage(model, settings, report, dtype, device, with_negative, budget=None, backend=None, fallback=None,
                  dtype_name: str = "fp32") -> dict[str, torch.Tensor]:
    from .prompt_cache import PromptCache, embeddings_key, text_backend_label

    adapter = model.adapter
    names = _present(model, adapter.encode_components)
    fingerprint = text_fingerprint(model)
    prompts = PromptCache(embeddings_key(fingerprint, model.class_name, settings.prompt, settings.negative_prompt,
                                         with_negative, dtype, text_backend_label(backend, names)))
    cached = prompts.lookup()  # a hit never loads a text encoder
    if cached is not None:
        tensors = _run_stage(report, device, "encode", [], lambda: ({k: v.to(device) for k, v in cached.items()}, 0))
        report.stages[-1].note = "cache hit"
        return tensors
    compiled: list = []
    fit = _Fit("encode", settings, with_negative, dtype_name)

    def work():
        pipe = _load_stage(model, names, dtype, device, budget, report, fit)
        compile_stage(pipe, model.path, backend, fallback, compiled)
        with torch.inference_mode():
            embeddings = adapter.encode(pipe, settings, with_negative)
        return {k: v.clone() for k, v in embeddings.items()}, _resident_bytes(pipe, names)

    tensors = _run_stage(report, device, "encode", names, work, compiled, fit)
    prompts.save(tensors, model.class_name, fingerprint, settings.prompt, settings.negative_prompt)
    return tensors


@collects_only_its_own_garbage
def encode(
    prompt: str,
    *,
    model: str | Path | None = None,
    negative_prompt: str | None = None,
    dtype: str = "fp32",
    device: str | torch.device | None = None,
) -> tuple[Embeddings, RunReport]:
    """Run only the encode stage; the embeddings carry both guidance branches."""
    folder = _open_model(model)
    device = torch.device(device) if device is not None else _default_device()
    adapter = folder.adapter
    settings = adapter.resolve(prompt, negative_prompt, 1, None, 0, None, None, folder.defaults)
    report = RunReport(device=str(device), dtype=dtype, model=str(folder.path))
    tensors = _encode_stage(folder, settings, report, parse_dtype(dtype), device, with_negative=True)
    embeddings = Embeddings(tensors, folder.class_name, text_fingerprint(folder), settings.prompt, settings.negative_prompt)
    return embeddings, report


@dataclass
class Generation:
    """What memfit.generate returns: the images, the settings actually used, and the run report."""

    images: list
    settings: Settings
    report: RunReport
    metadata: dict[str, str] = field(default_factory=dict)

    def save(self, path: str | Path, index: int = 0) -> Path:
        return save_png(self.images[index], path, self.metadata)


def save_png(image, path: str | Path, metadata: dict[str, str]) -> Path:
    """Write a PNG with text metadata atomically: no partial file is ever left at `path`."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in metadata.items():
        info.add_text(key, str(value))
    return write_atomically(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=info))


def _load_embeddings(source, model: ModelFolder) -> Embeddings:
    embeddings = source if isinstance(source, Embeddings) else Embeddings.load(source)
    where = f"{source}" if not isinstance(source, Embeddings) else "The embeddings"
    if embeddings.pipeline_class != model.class_name:
        raise MemfitError(
            f"{where} were made for a {embeddings.pipeline_class}, but {model.path} is a {model.class_name}; "
            f"encode the prompt again with memfit encode --model {model.path}."
        )
    if embeddings.text_fingerprint != text_fingerprint(model):
        raise MemfitError(
            f"{where} were made by a different text encoder than the one in {model.path}; "
            f"encode the prompt again with memfit encode --model {model.path}."
        )
    return embeddings


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
    budget=None,
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
    (bytes, "2GiB", or a Budget) bounds each stage's peak: the process's own memory, resident
    weights, streamed blocks in flight and activations. Blocks that do not fit are streamed
    (memfit.optimize); activations are bounded by an exact strategy where needed (banded VAE
    decode, split guidance passes: memfit.activations). The report shows each stage's planned
    peak and strategy; its notes show the plan. `backend` (a name,
    a Backend, or {component: backend}) compiles each stage's entry points after loading
    (memfit.compile); a backend failure raises unless `fallback="eager"`, and the report says so.
    `refiner` (an SDXL refiner folder) runs diffusers' base + refiner workflow: the base stops at
    `refiner_start` (default 0.8) of the schedule and the refiner finishes (memfit.refiner).
    `true_cfg_scale` (Flux) and `num_frames` (video pipelines) only apply to pipelines that take them.
    """
    if refiner is not None:
        from .refiner import DEFAULT_REFINER_START, generate_with_refiner

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
    folder = _open_model(model)
    adapter = folder.adapter
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device) if device is not None else _default_device()

    loaded = None
    if embeddings is not None:
        if prompt is not None or negative_prompt is not None:
            raise MemfitError("Pass either a prompt or an embeddings file, not both: the embeddings already fix the prompt.")
        loaded = _load_embeddings(embeddings, folder)
        prompt, negative_prompt = loaded.prompt, loaded.negative_prompt
    settings = adapter.resolve(prompt, negative_prompt, steps, guidance, seed, width, height, folder.defaults,
                               true_cfg_scale=true_cfg_scale, num_frames=num_frames)
    guided = adapter.guided(settings)
    report = RunReport(device=str(device), dtype=dtype, model=str(folder.path), settings=settings.__dict__.copy())
    if budget is not None:
        return_large_frees_to_os()  # freed activations leave RSS at once, so stages stay within plan

    if loaded is None:
        tensors = _encode_stage(folder, settings, report, torch_dtype, device, with_negative=guided, budget=budget,
                                backend=backend, fallback=fallback, dtype_name=dtype)
    else:
        if guided and not loaded.has_negative:
            raise MemfitError("These embeddings have no negative prompt branch; generate with --guidance 1 or encode again.")
        tensors = {name: t.to(device) for name, t in loaded.tensors.items()}
        report.notes.append("encode stage skipped: embeddings loaded from file")

    negative = tensors.get("negative_prompt_embeds") if guided else None
    if negative is not None and negative.shape[1] != tensors["prompt_embeds"].shape[1]:
        report.notes.append(
            f"prompt embeddings of lengths {tensors['prompt_embeds'].shape[1]} (positive) and {negative.shape[1]} "
            f"(negative): {adapter.unequal_lengths}"
        )
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)

    denoise_names = _present(folder, adapter.denoise_components)
    denoise_compiled: list = []
    denoise_fit = _Fit("denoise", settings, guided, dtype)

    def denoise():
        pipe = _load_stage(folder, denoise_names, torch_dtype, device, budget, report, denoise_fit)
        compile_stage(pipe, folder.path, backend, fallback, denoise_compiled)
        pipe.set_progress_bar_config(disable=not progress, desc="denoise", leave=False)
        with torch.inference_mode():
            latents = adapter.denoise(pipe, tensors, settings, generator, split=denoise_fit.strategy == "split")
        return latents.clone(), _resident_bytes(pipe, denoise_names)

    latents = _run_stage(report, device, "denoise", denoise_names, denoise, denoise_compiled, denoise_fit)
    del tensors

    decode_names = _present(folder, adapter.decode_components)
    decode_compiled: list = []
    decode_fit = _Fit("decode", settings, guided, dtype)

    def decode():
        pipe = _load_stage(folder, decode_names, torch_dtype, device, budget, report, decode_fit)
        if decode_fit.strategy == "banded":
            from .banded_decode import enable_banded_decode

            enable_banded_decode(pipe.vae)
        compile_stage(pipe, folder.path, backend, fallback, decode_compiled)
        with torch.inference_mode():
            images = adapter.decode(pipe, latents, generator)
        return images, _resident_bytes(pipe, decode_names)

    images = _run_stage(report, device, "decode", decode_names, decode, decode_compiled, decode_fit)
    return Generation(images, settings, report, _png_metadata(settings, folder, dtype))


def _png_metadata(settings: Settings, folder: ModelFolder, dtype: str) -> dict[str, str]:
    from . import __version__

    return {
        "prompt": settings.prompt,
        "negative_prompt": settings.negative_prompt or "",
        "seed": str(settings.seed),
        "steps": str(settings.steps),
        "guidance": str(settings.guidance),
        "width": str(settings.width),
        "height": str(settings.height),
        "dtype": dtype,
        "model": str(folder.path),
        "pipeline": folder.class_name,
        "memfit_version": __version__,
    }
