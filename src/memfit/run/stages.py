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
from memfit.models.families import Settings
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


def encode_stage(folders: list[tuple[str, ModelFolder]], settings: Settings, with_negative: bool) -> Stage:
    """The text encoders of each (label, folder), in order; returns {label: embedding tensors}.

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
            cache = PromptCache(embeddings_key(
                folder.text_fingerprint, folder.class_name, settings.prompt, settings.negative_prompt, with_negative,
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
            pipe = context.load(folder, names, shared=shared, label=f"{label}." if label != "base" else "")
            for name, fingerprint in prints.items():
                if isinstance(getattr(pipe, name, None), torch.nn.Module):
                    loaded.setdefault(fingerprint, getattr(pipe, name))
            with torch.inference_mode():
                embeddings = folder.adapter.encode(pipe, settings, with_negative)
            tensors[label] = {k: v.clone() for k, v in embeddings.items()}
            cache.save(tensors[label], folder.class_name, folder.text_fingerprint, settings.prompt,
                       settings.negative_prompt)
        if hits:
            context.note = "cache hit" if len(folders) == 1 else f"cache hit ({', '.join(hits)})"
        return tensors

    return Stage("encode", work)


def denoise_stage(folder: ModelFolder, settings: Settings, embeddings: Callable[[dict], dict], generator, *,
                  name: str = "denoise", run: Callable | None = None, label: str = "") -> Stage:
    """The denoiser's loop on the embeddings ``embeddings(results)`` picks; returns the latents.

    ``run(adapter, pipe, embeddings, results, split)`` replaces the adapter's own denoise call
    (the refiner's hand-over uses it).
    """

    def work(context: StageContext, results: dict[str, Any]) -> torch.Tensor:
        adapter = folder.adapter
        pipe = context.load(folder, adapter.denoise_components, plan_as="denoise", label=label)
        split = context.strategy == "split"
        with torch.inference_mode():
            if run is None:
                latents = adapter.denoise(pipe, embeddings(results), settings, generator, split=split)
            else:
                latents = run(adapter, pipe, embeddings(results), results, split)
        return latents.clone()

    return Stage(name, work, generators=(generator,))


def decode_stage(folder: ModelFolder, settings: Settings, generator, latents_from: str = "denoise") -> Stage:
    """The VAE on the latents of stage ``latents_from``; returns the images (or a video's frames)."""

    def work(context: StageContext, results: dict[str, Any]) -> list:
        pipe = context.load(folder, folder.adapter.decode_components)
        with torch.inference_mode():
            return folder.adapter.decode(pipe, results.pop(latents_from), settings, generator)

    return Stage("decode", work, generators=(generator,))


@dataclass
class Generation:
    """What memfit.generate returns: the images, the settings actually used, and the run report."""

    images: list
    settings: Settings
    report: Any
    metadata: dict[str, str] = field(default_factory=dict)
    timeline: Any = None  # memfit.run.timeline.Timeline: weight movements and memory over the run

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
