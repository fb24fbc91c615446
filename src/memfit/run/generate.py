"""memfit.generate and memfit.encode: staged generation as lists of stages for the one runner.

generate is encode -> denoise -> decode (memfit.run.stages), or with a refiner the base + refiner
workflow (memfit.run.refiner); encode is the encode stage alone. memfit.run.runner loads, fits,
runs and releases each stage, so peak memory is the largest stage, and the image equals plain
diffusers'.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.models.families import ADAPTERS, TEXT2IMG, Conditioning, supporting
from memfit.models.lora import check_loras
from memfit.plan.budget import ABOVE_PROCESS
from memfit.run.embeddings import Embeddings
from memfit.run.fit import check_budget_floor
from memfit.run.libraries import quiet_libraries
from memfit.run.memory import collects_only_its_own_garbage
from memfit.run.options import RunOptions, StagePool
from memfit.run.prompt_cache import image_fingerprint
from memfit.run.report import RunReport
from memfit.run.runner import StageRunner
from memfit.run.stages import (
    Generation,
    check_backend_takes_stored_weights,
    check_embeddings,
    decode_stage,
    denoise_stage,
    encode_stage,
    open_model,
    pipeline_stage,
    run_result,
    source_notes,
)
from memfit.run.threads import start_looking_at_cpus

__all__ = ["Generation", "check_conditioning", "encode", "generate"]

# The Embeddings metadata entry holding the input image's content digest, where the text encoders saw one.
IMAGE_FINGERPRINT = "image_fingerprint"


def _begin(threads: int | None) -> None:
    if threads is None:
        start_looking_at_cpus()  # how busy the CPUs are is measured while the model opens, not in a wait of its own
    quiet_libraries()


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
    allow_pickle: bool = False,
    config: str | Path | None = None,
    components: dict[str, str | Path] | None = None,
    quantize: dict[str, str] | None = None,
    threads: int | None = None,
    image=None,
) -> tuple[Embeddings, RunReport]:
    """Run only the encode stage; the embeddings carry both guidance branches. ``model``, ``config``,
    ``components``, ``quantize`` and ``threads`` as memfit.generate's. ``image`` (a PIL image or a file; a list for
    Qwen-Image-Edit-Plus's several) is the input image of a family whose text encoders see it (Qwen-Image-Edit),
    which needs it; the embeddings record its content, and generate refuses them with another image."""
    _begin(threads)
    folder = open_model(model, allow_pickle=allow_pickle, config=config, components=components, quantize=quantize)
    if not folder.adapter.staged:
        raise MemfitError(_not_staged(folder, "encode prompts on their own"))
    image = _open_images(image, "--image", "RGB")
    check_image_count(folder.adapter, image)
    if folder.adapter.prompt_sees_image and image is None:
        raise MemfitError(f"{folder.class_name} encodes the prompt together with the image it edits: pass --image IMG "
                          "(memfit.encode(..., image=...)).")
    if image is not None and not folder.adapter.prompt_sees_image:
        raise MemfitError(f"{folder.class_name}'s text encoders do not see the input image, so its embeddings do not "
                          "depend on it: leave --image out of memfit encode.")
    check_backend_takes_stored_weights(folder, backend, fallback)
    options = RunOptions.build(device=device, dtype=dtype, budget=budget, backend=backend, fallback=fallback,
                               progress=False, allow_pickle=allow_pickle, threads=threads)
    settings = folder.adapter.resolve(prompt, negative_prompt, 1, None, 0, None, None, folder.defaults,
                                      makes_images=False)
    report = RunReport(device=str(options.device), dtype=dtype, model=str(folder.path), notes=source_notes(folder))
    runner = StageRunner(options, report=report, settings=settings, guided=True)
    tensors = runner.run([encode_stage([("base", folder)], settings, with_negative=True, image=image)])["encode"]["base"]
    extra = {IMAGE_FINGERPRINT: image_fingerprint(image)} if image is not None else {}
    embeddings = Embeddings(tensors, folder.class_name, folder.text_fingerprint, settings.prompt, settings.negative_prompt,
                            extra=extra)
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
    refiner_config: str | Path | None = None,
    true_cfg_scale: float | None = None,
    frames: int | None = None,
    num_frames: int | None = None,
    guidance_scale_2: float | None = None,
    allow_pickle: bool = False,
    image=None,
    strength: float | None = None,
    mask=None,
    control_image=None,
    controlnet: str | Path | None = None,
    loras=(),
    sampler: str | None = None,
    precision: str | None = None,
    pool: StagePool | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
    config: str | Path | None = None,
    components: dict[str, str | Path] | None = None,
    quantize: dict[str, str] | None = None,
    threads: int | None = None,
) -> Generation:
    """Generate an image with a diffusers model folder or an all-in-one checkpoint file, one stage resident at a
    time.

    `model` defaults to memfit's built-in demo model. A checkpoint file (A1111's and ComfyUI's all-in-one
    .safetensors) takes its configs and tokenizers from `config` (a diffusers folder of its family; only
    those are read), else from the Hugging Face cache, else (online) fetched once (memfit.models.single_file_configs);
    its weights stream from the file as a folder's do. `components` ({"vae": "vae.safetensors"}) replaces
    components of the model, folder or checkpoint, by single files of their own (a UNet, VAE or CLIP text
    encoder in its original or diffusers layout; GGUF and fp8 files stay quantized), streamed from those files the
    same way. `quantize` ({"transformer": "q8_0"}; fp8, int8, q8_0, q6_k, q5_k, q5_1, q5_0, q4_1, q4_0, q4_k, q3_k,
    q2_k) quantizes components on the fly, once, into memfit's cache (memfit.models.quantize). With `embeddings` (a file from
    `memfit encode` or an Embeddings object) the encode stage is skipped entirely. `budget`
    ("auto", the default: what this machine, container or GPU can spare now; "none": no planning;
    bytes, "2GiB", or a Budget) bounds each stage's peak: the process's own memory, resident
    weights, streamed blocks in flight and activations. Blocks that do not fit are streamed
    (memfit.optimize); activations are bounded by an exact strategy where needed (banded VAE
    decode, split guidance passes: memfit.plan.activations). The report shows each stage's planned
    peak and strategy; its notes show the plan. `backend` (a name,
    a Backend, or {component: backend}) compiles each stage's entry points after loading
    (memfit.compile.entry_points); a backend failure raises unless `fallback="eager"`, and the report says so.
    `refiner` (an SDXL refiner folder, or a refiner checkpoint file with its configs from `refiner_config` or
    found as `config` is) runs diffusers' base + refiner workflow: the base stops at `refiner_start` (default
    0.8) of the schedule and the refiner finishes (memfit.run.refiner).

    Beyond text to image (the family's own diffusers pipeline for each, PipelineAdapter.tasks):
    `image` (a PIL image or a file; a list of them for a pipeline that takes several, Qwen-Image-Edit-Plus) runs
    img2img, noised by `strength` (a family that edits, refers to or animates it, FLUX.1 Kontext, FLUX.2 and Wan
    image to video, takes it as it is); with `mask` (white = repaint) it inpaints (FLUX.1 Fill needs both); `control_image` with `controlnet` (a ControlNet model folder; a ControlNet pipeline
    folder has its own) steers every step, the ControlNet loaded and planned in the denoise stage.
    `loras` are LoRA files, each a path, "PATH:SCALE" or (path, scale), loaded unfused with diffusers'
    load_lora_weights into the text encoders and the denoiser. `frames` (the CLI's `--frames`; `num_frames`,
    diffusers' name, is the same setting) is a video pipeline's length. `guidance_scale_2` guides Wan 2.2's
    low-noise expert (default: `guidance`).

    `sampler` (an AUTOMATIC1111 sampler name, memfit.run.samplers) replaces the model's scheduler and
    is recorded in the PNG. `pool` (a StagePool, memfit.run.session.Session's) keeps stages loaded between
    calls; `on_step(stage, done, total)` is called as the denoising loop advances, and with done = total = 0 as
    each stage starts (it may raise to stop the run).
    `precision` ("fp32", "bf16", "fp16"; default: `dtype`) is the compute precision of a backend that has
    its own (OpenVINO), apart from the weights' `dtype`; any other backend, or none, must compute in
    `dtype` (memfit.compile.precision). It is recorded in the PNG.
    `threads` is how many threads torch computes with during the run (default: the CPUs this process may
    really use: its affinity, its cgroup's CPU quota, less those other processes keep busy; OMP_NUM_THREADS
    where set: memfit.run.threads); torch's own count is put back when the run ends. The report says which.
    """
    _begin(threads)
    if frames is not None and num_frames is not None and frames != num_frames:
        raise MemfitError(f"frames={frames} and num_frames={num_frames} name the same setting; pass one of them.")
    num_frames = frames if frames is not None else num_frames
    if precision is not None:
        from memfit.compile.precision import with_precision

        backend = with_precision(backend, precision, dtype)  # refused before anything loads
    conditioning = Conditioning(
        image=_open_images(image, "--image", "RGB"), mask_image=_open_image(mask, "--mask", None),
        control_image=_open_image(control_image, "--control-image", "RGB"),
        controlnet=None if controlnet is None else str(Path(controlnet).expanduser()), loras=check_loras(loras))
    if refiner is not None and conditioning != Conditioning():
        raise MemfitError("--refiner cannot be combined with --image, --mask, --control-image or --lora yet.")
    if refiner is not None and (sampler is not None or pool is not None):
        raise MemfitError("--sampler and sessions do not combine with --refiner yet; leave them out.")
    options = RunOptions.build(device=device, dtype=dtype, budget=budget, backend=backend, fallback=fallback,
                               progress=progress, allow_pickle=allow_pickle, pool=pool, on_step=on_step,
                               threads=threads)
    if config is not None or components or quantize:
        model = open_model(model, allow_pickle=allow_pickle, config=config, components=components, quantize=quantize)
    if refiner is not None:
        from memfit.run.refiner import DEFAULT_REFINER_START, generate_with_refiner

        if embeddings is not None:
            raise MemfitError("--embeddings cannot be combined with --refiner yet: the refiner needs its own encode; pass --prompt.")
        return _with_precision(generate_with_refiner(
            prompt, options, model=model, refiner=refiner, refiner_config=refiner_config,
            refiner_start=DEFAULT_REFINER_START if refiner_start is None else refiner_start,
            negative_prompt=negative_prompt, steps=steps, guidance=guidance, seed=seed, width=width, height=height,
        ), backend, precision, dtype)
    for flag, value in (("--refiner-start", refiner_start), ("--refiner-config", refiner_config)):
        if value is not None:
            raise MemfitError(f"{flag} only applies with --refiner REFINER.")
    folder = open_model(model, allow_pickle=allow_pickle)
    check_backend_takes_stored_weights(folder, backend, fallback)
    adapter = folder.adapter

    loaded = None
    if not adapter.staged and embeddings is not None:
        raise MemfitError(_not_staged(folder, "generate from an embeddings file"))
    if embeddings is not None:
        if prompt is not None or negative_prompt is not None:
            raise MemfitError("Pass either a prompt or an embeddings file, not both: the embeddings already fix the prompt.")
        loaded = embeddings if isinstance(embeddings, Embeddings) else Embeddings.load(embeddings)
        where = "The embeddings" if isinstance(embeddings, Embeddings) else str(embeddings)
        check_embeddings(loaded, folder, where)
        if adapter.prompt_sees_image and conditioning.image is not None and \
                loaded.extra.get(IMAGE_FINGERPRINT) != image_fingerprint(conditioning.image):
            raise MemfitError(f"{where} were encoded with another input image than this --image, and "
                              f"{folder.class_name}'s prompt embeddings depend on the image: encode again with "
                              "memfit encode --image IMG, or pass --prompt.")
        prompt, negative_prompt = loaded.prompt, loaded.negative_prompt
    check_conditioning(adapter, conditioning, loaded is not None)
    settings = adapter.resolve(prompt, negative_prompt, steps, guidance, seed, width, height, folder.defaults,
                               true_cfg_scale=true_cfg_scale, num_frames=num_frames,
                               guidance_scale_2=guidance_scale_2, conditioning=conditioning,
                               strength=strength)
    guided = adapter.guided(settings)
    report = RunReport(device=str(options.device), dtype=dtype, model=str(folder.path), settings=settings.__dict__.copy(),
                       notes=source_notes(folder))
    runner = StageRunner(options, report=report, settings=settings, guided=guided)
    # An automatic budget is what there is: nothing to name instead.
    if runner.resolved.mode in ("explicit", ABOVE_PROCESS):
        # What a Session keeps loaded is not this process's floor: its pool lets it go when a stage needs the room.
        kept = options.pool.weights_bytes() if hasattr(options.pool, "weights_bytes") else 0
        check_budget_floor(adapter, settings, dtype, runner.budget, options.runtime,
                           above_process=runner.resolved.mode == ABOVE_PROCESS,
                           in_use=options.runtime.memory_in_use() - kept if kept else None)
    if sampler is not None:  # refused before anything loads when it does not fit the model
        from memfit.run.samplers import resolve_sampler

        resolve_sampler(sampler, folder.components.get("scheduler", ("", ""))[1])

    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    if not adapter.staged:
        if sampler is not None:
            raise MemfitError(_not_staged(folder, "replace the scheduler (--sampler)", "Leave --sampler out."))
        return _with_precision(run_result(runner.run([pipeline_stage(folder, settings, generator)])["pipeline"],
                                          settings, report, folder, dtype, timeline=runner.timeline),
                               backend, precision, dtype)
    stages = []
    if loaded is None:
        stages.append(encode_stage([("base", folder)], settings, with_negative=guided, loras=conditioning.loras,
                                   image=conditioning.image))
    else:
        if guided and not loaded.has_negative:
            raise MemfitError("These embeddings have no negative prompt branch; generate with --guidance 1 or encode again.")
        report.notes.append("encode stage skipped: embeddings loaded from file")

    def prompt_embeddings(results):
        tensors = results.pop("encode")["base"] if loaded is None else {
            name: t.to(runner.device) for name, t in loaded.tensors.items()}
        for name, dim in adapter.text_sequences if guided else ():
            positive, negative = tensors.get(name), tensors.get(f"negative_{name}")
            if positive is not None and negative is not None and negative.shape[dim] != positive.shape[dim]:
                report.notes.append(
                    f"{name} of lengths {positive.shape[dim]} (positive) and {negative.shape[dim]} "
                    f"(negative): {adapter.unequal_lengths}"
                )
        return tensors

    stages += [denoise_stage(folder, settings, prompt_embeddings, generator, conditioning=conditioning, sampler=sampler),
               decode_stage(folder, settings, generator)]
    result = run_result(runner.run(stages)["decode"], settings, report, folder, dtype, timeline=runner.timeline)
    if sampler is not None:
        result.metadata["sampler"] = sampler
    return _with_precision(result, backend, precision, dtype)


def _with_precision(result, backend, precision: str | None, dtype: str):
    """Record a compiled run's compute precision in the image's metadata (the PNG): it changes pixels."""
    if backend is not None:
        result.metadata["precision"] = precision or dtype
    return result


def check_image_count(adapter, image) -> None:
    """Refuse several input images (a list) where the pipeline takes one (PipelineAdapter.takes_several_images)."""
    if isinstance(image, (list, tuple)) and not adapter.takes_several_images:
        several = sorted(name for name, other in ADAPTERS.items() if other.takes_several_images)
        raise MemfitError(f"{adapter.class_name} takes one --image, and {len(image)} were given: pass one "
                          f"(several are taken by {', '.join(several)}).")


def check_conditioning(adapter, conditioning: Conditioning, from_embeddings: bool) -> None:
    """Refuse, naming the flag, what this family does not run yet (and the families that do)."""
    from memfit.models.families.base import TASK_FLAGS

    task = conditioning.task
    check_image_count(adapter, conditioning.image)
    adapter.refuse_missing_image(conditioning)
    if adapter.needs_control_image and conditioning.control_image is None:
        raise MemfitError(f"{adapter.class_name} draws from a control image: pass --control-image IMG "
                          "(memfit.generate(..., control_image=...)).")
    if task != TEXT2IMG and task not in adapter.tasks:
        flag = TASK_FLAGS[task].split(" with ")[0] if conditioning.mask_image is None else "--mask"
        raise MemfitError(f"{adapter.class_name} does not take {flag} yet; supported: {', '.join(supporting(task))}.")
    if conditioning.loras:
        if not adapter.takes_lora:
            lora_families = sorted(name for name, a in ADAPTERS.items() if a.takes_lora)
            raise MemfitError(f"{adapter.class_name} does not take --lora yet; supported: {', '.join(lora_families)}.")
        if from_embeddings:
            raise MemfitError("--lora cannot be combined with --embeddings: a LoRA may change the text encoders; "
                              "pass --prompt instead.")


def _open_images(value, flag: str, mode: str | None):
    """_open_image of each of several images (a list or tuple: a pipeline that takes several); a list of one is
    that one image, an empty list none."""
    if not isinstance(value, (list, tuple)):
        return _open_image(value, flag, mode)
    images = [_open_image(item, flag, mode) for item in value]
    return None if not images else images[0] if len(images) == 1 else images


def _open_image(value, flag: str, mode: str | None):
    """A PIL image from a PIL image or a file path; None stays None."""
    if value is None:
        return None
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise MemfitError(f"{flag} {path}: no such image file.")
    try:
        with Image.open(path) as opened:
            image = opened.convert(mode) if mode else opened.copy()
    except (OSError, ValueError) as exc:
        raise MemfitError(f"{flag} {path} is not an image Pillow can read ({exc}).") from None
    return image


def _not_staged(folder, what: str, instead: str = "Pass --prompt instead.") -> str:
    return (f"memfit cannot {what} for {folder.class_name} ({folder.path}): it has no adapter, so memfit runs the "
            f"pipeline's own __call__, which encodes the prompt itself. {instead} Families with an adapter: "
            f"{', '.join(sorted(ADAPTERS))}.")
