"""The stages memfit runs, as memfit.run.runner Stages: encode, denoise, decode, and what they return.

Each stage runs the family's own code through its adapter (memfit.models.families), so the image
equals plain diffusers'. memfit.run.generate and memfit.run.refiner put them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import contextlib
import logging
import warnings

import torch

from memfit.errors import MemfitError, MemfitWarning
from memfit.models.families import Conditioning, Settings
from memfit.models.folder import ModelFolder
from memfit.models.model_path import open_model_path, with_components
from memfit.plan.activations import DENOISE_HEAP_THRESHOLD, StrategyKind
from memfit.run.media import IMAGE_SUFFIXES, VIDEO_SUFFIXES, save_png, save_video
from memfit.run.memory import every_temporary_from_heap, heap_for_temporaries_under
from memfit.run.runner import Stage, StageContext

__all__ = ["Generation", "check_backend_takes_stored_weights", "check_embeddings", "check_frame_rate", "decode_stage", "denoise_stage",
           "encode_stage", "open_model", "pipeline_stage", "png_metadata", "run_result", "source_notes"]


def open_model(model: str | Path | ModelFolder | None, *, allow_pickle: bool = False,
               config: str | Path | None = None, components: dict[str, str | Path] | None = None,
               quantize: dict[str, str] | None = None) -> ModelFolder:
    """The model at a path, its layout checked: a diffusers folder, or an all-in-one single-file checkpoint with
    its configs from ``config`` (a diffusers folder of its family) or where memfit finds them
    (memfit.models.model_path); None is memfit's built-in demo model. ``components`` (name -> file) replaces
    those components by single files of their own (``--component vae=FILE``); ``quantize`` (name -> type)
    quantizes those on the fly, once (memfit.models.quantize).

    ``allow_pickle`` loads pickle checkpoints (.bin, .pt, .ckpt, ...) with torch's weights_only loader;
    without it they are refused.
    """
    if isinstance(model, ModelFolder):
        folder = with_components(model, components, allow_pickle=allow_pickle, quantize=quantize)
    else:
        if model is None:
            from memfit.demo import model_dir

            model = model_dir()
        folder = open_model_path(model, config=config, allow_pickle=allow_pickle, components=components,
                                 quantize=quantize)
    folder.check_layout()
    if allow_pickle:
        folder.allow_pickle = True
    return folder


def check_backend_takes_stored_weights(folder: ModelFolder, backend, fallback) -> None:
    """Refuse, before anything loads, a backend that compiles a model of its own (OpenVINO, ONNX Runtime) for a
    component stored quantized (a GGUF or fp8 file, --quantize) in a format it does not compile from
    (``Backend.stored_formats``; OpenVINO keeps int8, Q8_0 and Q4_0 compressed): its export would fail on the
    stored weights only once the stages before it have run. With a fallback the component runs eagerly, as asked."""
    stored = list(folder.adapter.measured_sizes)  # the components sized from stored weights (memfit.quant)
    if backend is None or fallback is not None or not stored:
        return
    from memfit.compile.entry_points import served_by_own_weights

    for name, chosen in served_by_own_weights(folder.components, stored, backend).items():
        formats = _stored_formats(folder, name)
        if formats is not None and formats <= chosen.stored_formats:
            continue
        weights = getattr(folder, "weights", {}).get(name)
        source = f" in {weights.path}" if weights is not None else ""
        stored_as = f" as {', '.join(sorted(formats))}" if formats else ""
        if chosen.stored_formats:
            taken = sorted(chosen.stored_formats, key=str.lower)
            why = (f", which takes quantized weights stored as {', '.join(taken)} only (--quantize "
                   f"{name}={', '.join(f.lower() for f in taken)})")
        else:
            why = " from float weights, which it cannot read from stored ones"
        raise MemfitError(
            f"The {name} is stored quantized{stored_as}{source}, and the {chosen.name} backend compiles a model of "
            f"its own{why}. Compile the {name} with --backend inductor (or run it eagerly: no --backend), compile "
            f"only the other components (--backend vae={chosen.name}), or pass --fallback eager to run the {name} "
            "eagerly."
        )


def _stored_formats(folder: ModelFolder, name: str) -> set[str] | None:
    """The formats (StoredFormat.name) component ``name`` of ``folder`` stores its quantized weights in; None where
    the folder does not say (a plan of --quantize, which writes nothing)."""
    weights = getattr(folder, "weights", {}).get(name)
    if weights is None:
        return None
    stored = weights.checkpoint.stored
    return {stored[key].format.name for key in weights.keys() if key in stored}


def source_notes(folder: ModelFolder) -> list[str]:
    """What a run report says first about where ``folder``'s parts came from (a single file's configs)."""
    note = folder.describe_source()
    return [note] if note else []


def check_finite(tensors, stage: str, folder: ModelFolder, components) -> None:
    """Raise, naming the stage, if a stage's result holds NaN or infinity (NaN weights, an fp16
    overflow): an image made from it would be black, never an exit 0."""
    items = tensors.items() if isinstance(tensors, dict) else [("latents", tensors)]
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise MemfitError(
                f"The {stage} stage produced non-finite values (NaN or inf) in its {name}; check the weights of "
                f"{', '.join(str(folder.path / c) for c in components)} (re-download them) or run at --dtype fp32."
            )


class PromptTruncatedWarning(MemfitWarning):
    """A prompt longer than a text encoder takes was cut."""


@contextlib.contextmanager
def _truncation_notices():
    """Collect diffusers' "input was truncated" notices, which memfit's quiet logging would drop."""
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "truncated" in message:
                found.append(message)

    logger = logging.getLogger("diffusers")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers, logger.propagate = [Collect()], False
    logger.setLevel(logging.WARNING)
    try:
        yield found
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)


def lora_fingerprint(loras) -> list[str]:
    """What of the LoRAs enters a prompt cache key: each file's content, its scale and its place."""
    from memfit.cache.fingerprint import fingerprint_path

    return [f"lora{index}:{fingerprint_path(path)}:{scale!r}" for index, (path, scale) in enumerate(loras)]


def encode_stage(folders: list[tuple[str, ModelFolder]], settings: Settings, with_negative: bool,
                 loras=(), image=None) -> Stage:
    """The text encoders of each (label, folder), in order; returns {label: embedding tensors}.

    ``loras`` ((file, scale) pairs) are loaded into the text encoders (those a LoRA file has keys for).
    ``image`` (a PIL image) is the input image, which a family whose text encoders see it (Qwen-Image-Edit:
    PipelineAdapter.prompt_sees_image) encodes with the prompt; the prompt cache then keys by its content.

    A repeated prompt is served from the prompt cache and loads no text encoder. A component whose
    content equals one an earlier folder of this stage loaded (an SDXL refiner's text_encoder_2) is
    that same object: loaded, fitted and compiled once.
    """

    def work(context: StageContext, results: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
        from memfit.cache import CacheMode, open_store
        from memfit.run.prompt_cache import PromptCache, embeddings_key, image_fingerprint, text_backend_label

        runner = context.runner
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        loaded: dict[str, Any] = {}  # component folder fingerprint -> live module
        hits = []
        # Fingerprints read every byte of a file the store holds no digest of: with the store off, none is taken
        # unless a later folder may share a component.
        store = open_store()
        for label, folder in folders:
            names = [name for name in folder.adapter.encode_components if name in folder.components]
            sees_image = folder.adapter.prompt_sees_image
            if sees_image and image is None:
                raise MemfitError(f"{folder.class_name} encodes the prompt together with the image it edits: pass "
                                  "--image IMG.")
            cache = None
            if store.mode is not CacheMode.OFF:
                text_fingerprint = folder.text_fingerprint
                if loras:
                    from memfit.cache.fingerprint import combine_fingerprints

                    text_fingerprint = combine_fingerprints([text_fingerprint, *lora_fingerprint(loras)])
                cache = PromptCache(embeddings_key(
                    text_fingerprint, folder.class_name, settings.prompt, settings.negative_prompt, with_negative,
                    runner.options.torch_dtype, text_backend_label(runner.options.backend, names),
                    image=image_fingerprint(image) if sees_image else None), store)
                found = cache.lookup()  # a hit never loads a text encoder
                if found is not None:
                    tensors[label] = {k: v.to(runner.device) for k, v in found.items()}
                    hits.append(label)
                    continue
            prints = {name: folder.component_fingerprint(name) for name in names
                      if len(folders) > 1 and (folder.path / name).is_dir()}
            shared = {name: loaded[prints[name]] for name in names if prints.get(name) in loaded}
            if shared:
                runner.report.notes.append(
                    f"encode: {label} shares {', '.join(sorted(shared))} with an earlier model (same content): loaded once")
            pipe = context.load(folder, names, shared=shared, label=f"{label}." if label != "base" else "", loras=loras)
            for name, fingerprint in prints.items():
                if isinstance(getattr(pipe, name, None), torch.nn.Module):
                    loaded.setdefault(fingerprint, getattr(pipe, name))
            with torch.inference_mode(), _truncation_notices() as cut:
                embeddings = folder.adapter.encode(pipe, settings, with_negative,
                                                   **({"image": image} if sees_image else {}))
            for notice in dict.fromkeys(cut):  # once each, however many encoders or branches saw it
                warnings.warn(f"The prompt is longer than {folder.path.name}'s text encoder takes and was cut: "
                              f"{notice.splitlines()[0]}", PromptTruncatedWarning, stacklevel=2)
            check_finite(embeddings, "encode", folder, names)
            tensors[label] = {k: v.clone() for k, v in embeddings.items()}
            if cache is not None:
                cache.save(tensors[label], folder.class_name, text_fingerprint, settings.prompt,
                           settings.negative_prompt)
        if hits:
            context.note = "cache hit" if len(folders) == 1 else f"cache hit ({', '.join(hits)})"
        return tensors

    return Stage("encode", work)


def denoise_stage(folder: ModelFolder, settings: Settings, embeddings: Callable[[dict], dict], generator, *,
                  name: str = "denoise", run: Callable | None = None, label: str = "",
                  conditioning: Conditioning | None = None, sampler: str | None = None) -> Stage:
    """The denoiser's loop on the embeddings ``embeddings(results)`` picks; returns the latents.

    ``run(adapter, pipe, embeddings, results, split)`` replaces the adapter's own denoise call
    (the refiner's hand-over uses it). ``conditioning`` (images, a ControlNet, LoRAs) runs the
    family's pipeline for its task (img2img, inpaint, ControlNet) with the VAE's encoder and the
    ControlNet loaded and planned in this stage, since they run in it. ``sampler`` (an
    AUTOMATIC1111 name, memfit.run.samplers) replaces the model's own scheduler for this run.
    """
    conditioning = conditioning or Conditioning()

    def work(context: StageContext, results: dict[str, Any]) -> torch.Tensor:
        from memfit.run.samplers import sampler_scheduler

        adapter = folder.adapter
        task = settings.task
        external = {"controlnet": Path(conditioning.controlnet)} if conditioning.controlnet else None
        pipe = context.load(folder, adapter.task_denoise_components(task), plan_as="denoise", label=label,
                            pipeline_class=adapter.pipeline_class(task), external=external, loras=conditioning.loras)
        chunked = context.strategy == StrategyKind.CHUNKED
        split = context.strategy == StrategyKind.SPLIT
        inputs = conditioning.pipeline_inputs()
        with torch.inference_mode(), sampler_scheduler(pipe, sampler), _chunked_if(chunked, pipe), \
                _heap_if(context.heap_temporaries):
            if run is None:
                latents = adapter.denoise(pipe, embeddings(results), settings, generator, split=split, inputs=inputs)
            else:
                latents = run(adapter, pipe, embeddings(results), results, split)
        check_finite(latents, name, folder, [c for c in adapter.denoise_components if c in folder.components])
        # A pipeline that denoises more than one latent (LTX-2's video and audio) hands over {name: latents}.
        return {key: value.clone() for key, value in latents.items()} if isinstance(latents, dict) else latents.clone()

    return Stage(name, work, generators=(generator,))


def _chunked_if(chunked: bool, pipe):
    """The denoiser's attention in chunks of query tokens while inside (the "chunked" strategy), else nothing."""
    if not chunked:
        return contextlib.nullcontext()
    from memfit.run.chunked_attention import chunked_attention

    return chunked_attention(getattr(pipe, "unet", None))


def _heap_if(planned: bool):
    """The denoising loop's temporaries from the heap while inside, where its plan counted that; else nothing."""
    return heap_for_temporaries_under(DENOISE_HEAP_THRESHOLD) if planned else contextlib.nullcontext()


def decode_stage(folder: ModelFolder, settings: Settings, generator, latents_from: str = "denoise") -> Stage:
    """The VAE on the latents of stage ``latents_from``; returns the images (or a video's frames)."""

    def work(context: StageContext, results: dict[str, Any]) -> list:
        pipe = context.load(folder, folder.adapter.decode_components)
        from memfit.compile.entry_points import is_compiled

        bad: list[bool] = []
        vae = getattr(pipe, "vae", None)
        decoder = getattr(vae, "decoder", None)
        # A compiled decode is traced, not run through its submodules: no hook (a check inside an
        # export would be a data-dependent guard), and the compiled output is not checked here.
        hook = decoder.register_forward_hook(
            lambda module, args, out: bad.append(isinstance(out, torch.Tensor) and not torch.isfinite(out).all())
        ) if isinstance(decoder, torch.nn.Module) and not is_compiled(vae) else None
        try:
            with torch.inference_mode(), (every_temporary_from_heap() if context.heap_temporaries
                                          else contextlib.nullcontext()):
                images = folder.adapter.decode(pipe, results.pop(latents_from), settings, generator)
        finally:
            if hook is not None:
                hook.remove()
        if any(bad):
            raise MemfitError(
                f"The decode stage produced non-finite values (NaN or inf); check the weights of {folder.path / 'vae'} "
                "(re-download them) or run at --dtype fp32."
            )
        return images

    return Stage("decode", work, generators=(generator,))


def pipeline_stage(folder: ModelFolder, settings: Settings, generator) -> Stage:
    """A pipeline without an adapter of its own: its __call__ in one stage, every component loaded
    and fitted to the budget together. Returns the images (or a video's frames)."""

    def work(context: StageContext, results: dict[str, Any]) -> list:
        context.note = f"{folder.class_name}'s own __call__ (no staged encode: no adapter for this class)"
        pipe = context.load(folder, list(folder.components))
        try:
            with torch.inference_mode():
                output = pipe(**folder.adapter.pipeline_kwargs(settings), generator=generator)
        except (TypeError, ValueError) as exc:
            raise MemfitError(
                f"{folder.class_name}'s own __call__ refused a text-to-image request ({type(exc).__name__}: {exc}). "
                "memfit runs a class without an adapter with the prompt, size, steps and guidance only."
            ) from exc
        images = getattr(output, "images", None)
        return list(images) if images is not None else list(output.frames[0])

    return Stage("pipeline", work, generators=(generator,))


@dataclass
class Generation:
    """What memfit.generate returns: the images (a video's frames), the settings used, and the run report.

    A video pipeline's result has ``frames`` (its one video, as plain diffusers' ``.frames[0]``)
    and no ``images``.
    """

    images: list
    settings: Settings
    report: Any
    metadata: dict[str, str] = field(default_factory=dict)
    frames: list | None = None
    frames_per_second: int | None = None
    # A video's soundtrack (LTX-2): a float waveform, channels x samples, at audio_sample_rate; None: silent.
    audio: Any = None
    audio_sample_rate: int | None = None
    timeline: Any = None  # memfit.run.timeline.Timeline: weight movements and memory over the run

    def save(self, path: str | Path, index: int = 0, frames_per_second: int | None = None) -> Path:
        """Write the image (.png) or the video (.mp4, .webp, .gif; .png writes its first frame)."""
        suffix = Path(path).suffix.lower()
        if suffix in VIDEO_SUFFIXES:
            if self.frames is None:
                raise MemfitError(f"{path}: {self.metadata.get('pipeline', 'this pipeline')} makes images, not a "
                                  "video; write a .png.")
            if self.audio is not None and frames_per_second not in (None, self.frames_per_second):
                raise MemfitError(_drift(self.metadata.get("pipeline", "this pipeline"), frames_per_second,
                                         self.frames_per_second))
            return save_video(self.frames, path, frames_per_second or self.frames_per_second, self.metadata,
                              audio=self.audio, sample_rate=self.audio_sample_rate)
        if suffix not in IMAGE_SUFFIXES:
            raise MemfitError(f"{path}: memfit writes images as .png and videos as {', '.join(VIDEO_SUFFIXES)}.")
        return save_png(self.frames[0] if self.frames is not None else self.images[index], path, self.metadata)


def check_frame_rate(adapter, frames_per_second: int | None) -> None:
    """Refuse, before a run, a frame rate its video's soundtrack was not made for (PipelineAdapter.makes_audio)."""
    if adapter.makes_audio and frames_per_second not in (None, adapter.frames_per_second):
        raise MemfitError(_drift(adapter.class_name, frames_per_second, adapter.frames_per_second))


def _drift(pipeline: str, asked: int, made_for: int) -> str:
    return (f"--fps {asked}: {pipeline} makes its soundtrack for {made_for} frames a second, so at {asked} the "
            f"pictures would drift from the sound; leave --fps out (the video plays at {made_for}).")


def run_result(output: list, settings: Settings, report, folder: ModelFolder, dtype: str, timeline=None) -> Generation:
    """The Generation for what the decode stage of `folder` returned."""
    adapter = folder.adapter
    metadata = png_metadata(settings, folder, dtype)
    if adapter.makes_video:
        return Generation([], settings, report, metadata, frames=list(output),
                          frames_per_second=adapter.frames_per_second, timeline=timeline,
                          audio=getattr(output, "audio", None), audio_sample_rate=getattr(output, "sample_rate", None))
    return Generation(list(output), settings, report, metadata, timeline=timeline)


def png_metadata(settings: Settings, folder: ModelFolder, dtype: str) -> dict[str, str]:
    """What an output file records about its run, enough to make it again."""
    from memfit.version import __version__

    metadata = {
        "prompt": settings.prompt,
        "negative_prompt": settings.negative_prompt or "",
        "seed": str(settings.seed),
        "steps": str(settings.steps),
        "guidance": str(settings.guidance),
        "width": str(settings.width),
        "height": str(settings.height),
    }
    for option in folder.adapter.options:  # the settings only some pipelines take
        value = getattr(settings, option)
        if value is not None:
            metadata[option] = str(value)
    if settings.task != "text2img":
        metadata["task"] = settings.task
    if settings.strength is not None:
        metadata["strength"] = str(settings.strength)
    return dict(metadata, dtype=dtype, model=str(folder.path), pipeline=folder.class_name, memfit_version=__version__)


def check_embeddings(embeddings, folder: ModelFolder, where: str) -> None:
    """Refuse embeddings made for another pipeline class or by other text encoders."""
    if embeddings.pipeline_class != folder.class_name:
        raise MemfitError(
            f"{where} were made for a {embeddings.pipeline_class}, but {folder.path} is a {folder.class_name}; "
            f"encode the prompt again with memfit encode --model {folder.path}."
        )
    if embeddings.text_fingerprint != folder.text_fingerprint:
        raise MemfitError(
            f"{where} were made by a different text encoder than the one in {folder.path}; "
            f"encode the prompt again with memfit encode --model {folder.path}."
        )
