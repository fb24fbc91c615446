"""The stages memfit runs, as memfit.run.runner Stages: encode, denoise, decode, and what they return.

Each stage runs the family's own code through its adapter (memfit.models.families), so the image
equals plain diffusers'. memfit.run.generate and memfit.run.refiner put them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.atomic import write_atomically
from memfit.errors import MemfitError
from memfit.models.families import Conditioning, Settings
from memfit.models.folder import ModelFolder
from memfit.run.runner import Stage, StageContext

__all__ = ["Generation", "decode_stage", "denoise_stage", "encode_stage", "open_model", "png_metadata", "save_png"]


def open_model(model: str | Path | ModelFolder | None) -> ModelFolder:
    """A ModelFolder for a path; None is memfit's built-in demo model."""
    if isinstance(model, ModelFolder):
        return model
    if model is None:
        from memfit.demo import model_dir

        model = model_dir()
    return ModelFolder.open(model)


def lora_fingerprint(loras) -> list[str]:
    """What of the LoRAs enters a prompt cache key: each file's content, its scale and its place."""
    import hashlib

    from memfit.cache.fingerprint import fingerprint_folder

    parts = []
    for index, (path, scale) in enumerate(loras):
        path = Path(path)
        content = fingerprint_folder(path) if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        parts.append(f"lora{index}:{content}:{scale!r}")
    return parts


def encode_stage(folders: list[tuple[str, ModelFolder]], settings: Settings, with_negative: bool,
                 loras=()) -> Stage:
    """The text encoders of each (label, folder), in order; returns {label: embedding tensors}.

    ``loras`` ((file, scale) pairs) are loaded into the text encoders (those a LoRA file has keys for).

    A repeated prompt is served from the prompt cache and loads no text encoder. A component whose
    content equals one an earlier folder of this stage loaded (an SDXL refiner's text_encoder_2) is
    that same object: loaded, fitted and compiled once.
    """

    def work(context: StageContext, results: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
        from memfit.run.prompt_cache import PromptCache, embeddings_key, text_backend_label

        runner = context.runner
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        loaded: dict[str, Any] = {}  # component folder fingerprint -> live module
        hits = []
        for label, folder in folders:
            names = [name for name in folder.adapter.encode_components if name in folder.components]
            text_fingerprint = folder.text_fingerprint
            if loras:
                from memfit.cache.fingerprint import combine_fingerprints

                text_fingerprint = combine_fingerprints([text_fingerprint, *lora_fingerprint(loras)])
            cache = PromptCache(embeddings_key(
                text_fingerprint, folder.class_name, settings.prompt, settings.negative_prompt, with_negative,
                runner.torch_dtype, text_backend_label(runner.backend, names)))
            found = cache.lookup()  # a hit never loads a text encoder
            if found is not None:
                tensors[label] = {k: v.to(runner.device) for k, v in found.items()}
                hits.append(label)
                continue
            prints = {name: folder.component_fingerprint(name) for name in names if (folder.path / name).is_dir()}
            shared = {name: loaded[prints[name]] for name in names if prints.get(name) in loaded}
            if shared:
                runner.report.notes.append(
                    f"encode: {label} shares {', '.join(sorted(shared))} with an earlier model (same content): loaded once")
            pipe = context.load(folder, names, shared=shared, label=f"{label}." if label != "base" else "", loras=loras)
            for name, fingerprint in prints.items():
                if isinstance(getattr(pipe, name, None), torch.nn.Module):
                    loaded.setdefault(fingerprint, getattr(pipe, name))
            with torch.inference_mode():
                embeddings = folder.adapter.encode(pipe, settings, with_negative)
            tensors[label] = {k: v.clone() for k, v in embeddings.items()}
            cache.save(tensors[label], folder.class_name, text_fingerprint, settings.prompt,
                       settings.negative_prompt)
        if hits:
            context.note = "cache hit" if len(folders) == 1 else f"cache hit ({', '.join(hits)})"
        return tensors

    return Stage("encode", work)


def denoise_stage(folder: ModelFolder, settings: Settings, embeddings: Callable[[dict], dict], generator, *,
                  name: str = "denoise", run: Callable | None = None, label: str = "",
                  conditioning: Conditioning | None = None) -> Stage:
    """The denoiser's loop on the embeddings ``embeddings(results)`` picks; returns the latents.

    ``run(adapter, pipe, embeddings, results, split)`` replaces the adapter's own denoise call
    (the refiner's hand-over uses it). ``conditioning`` (images, a ControlNet, LoRAs) runs the
    family's pipeline for its task (img2img, inpaint, ControlNet) with the VAE's encoder and the
    ControlNet loaded and planned in this stage, since they run in it.
    """
    conditioning = conditioning or Conditioning()

    def work(context: StageContext, results: dict[str, Any]) -> torch.Tensor:
        adapter = folder.adapter
        task = settings.task
        external = {"controlnet": Path(conditioning.controlnet)} if conditioning.controlnet else None
        pipe = context.load(folder, adapter.task_denoise_components(task), plan_as="denoise", label=label,
                            pipeline_class=adapter.pipeline_class(task), external=external, loras=conditioning.loras)
        split = context.strategy == "split"
        inputs = conditioning.pipeline_inputs()
        with torch.inference_mode():
            if run is None:
                extra = {"inputs": inputs} if inputs else {}
                latents = adapter.denoise(pipe, embeddings(results), settings, generator, split=split, **extra)
            else:
                latents = run(adapter, pipe, embeddings(results), results, split)
        return latents.clone()

    return Stage(name, work)


def decode_stage(folder: ModelFolder, settings: Settings, generator, latents_from: str = "denoise") -> Stage:
    """The VAE on the latents of stage ``latents_from``; returns the images (or a video's frames)."""

    def work(context: StageContext, results: dict[str, Any]) -> list:
        pipe = context.load(folder, folder.adapter.decode_components)
        with torch.inference_mode():
            return folder.adapter.decode(pipe, results.pop(latents_from), settings, generator)

    return Stage("decode", work)


@dataclass
class Generation:
    """What memfit.generate returns: the images, the settings actually used, and the run report."""

    images: list
    settings: Settings
    report: Any
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


def png_metadata(settings: Settings, folder: ModelFolder, dtype: str) -> dict[str, str]:
    """What a PNG records about its run, enough to make it again."""
    from memfit import __version__

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
        **({"task": settings.task, "strength": str(settings.strength)} if settings.strength is not None else
           {"task": settings.task} if settings.task != "text2img" else {}),
        "memfit_version": __version__,
    }


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
