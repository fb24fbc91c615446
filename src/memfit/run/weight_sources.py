"""Where a live component's weights are in its files, for the disk tier: one small interface, two kinds.

    source = weight_source("unet", module, model_dir)
    shared = source.find("down_blocks.0.resnets.0.conv1.weight")   # a Shared view of the file, or None

A component loaded from a diffusers folder maps its folder's safetensors files, its live names
paired with the stored keys by the libraries' own renaming (memfit.models.checkpoint_keys). A
component loaded from a single-file checkpoint carries the place of every live tensor in that file
(memfit.models.single_file.file_places): a key and the view the conversion made of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from memfit.errors import MemfitError
from memfit.models.checkpoint_keys import loaded_names
from memfit.models.single_file import FilePlaces, file_places
from memfit.run.offload import MappedSafetensors, Shared, mapped_view

__all__ = ["WeightSource", "in_memory_only", "weight_source"]


class WeightSource(Protocol):
    """The files a component's weights are read from: ``find(live name)`` is that weight's view of its file, or
    None when the file does not hold it; ``where`` names the files in messages."""

    where: Path

    def find(self, live_name: str) -> Shared | None: ...


class _FolderWeights:
    """A component folder's safetensors files; live names are paired with stored keys by loading's renaming."""

    def __init__(self, files: MappedSafetensors, module: torch.nn.Module):
        self.files = files
        self.where = files.folder
        self._prefix = getattr(module, "base_model_prefix", "") or ""
        self._keys: Mapping[str, str] = {live: key for key, live in (loaded_names(module, files.keys()) or {}).items()}

    def find(self, live_name: str) -> Shared | None:
        saved = self._keys.get(live_name, live_name)
        for key in (saved, f"{self._prefix}.{saved}", saved.removeprefix(self._prefix + ".")):
            if key in self.files:
                return self.files.shared(key)
        return None


class _PlacedWeights:
    """A component loaded from a single-file checkpoint: the places its loading recorded."""

    def __init__(self, places: FilePlaces):
        if places.file is None:
            raise MemfitError(f"{places.why}, so its weights cannot be read from disk: convert it to safetensors, or "
                              "give a budget that keeps them in memory.")
        self.places = places
        self.where = places.path

    def find(self, live_name: str) -> Shared | None:
        found = self.places.view(live_name)
        return None if found is None else mapped_view(*found)


def weight_source(name: str, module: torch.nn.Module, model_dir: str | Path | None) -> WeightSource:
    """The files component ``name``'s weights are read from: the checkpoint it was loaded from, else the first
    folder with safetensors files among ``model_dir``/``name``, ``model_dir`` and the folder its config names."""
    places = file_places(module)
    if places is not None:
        return _PlacedWeights(places)
    candidates = []
    if model_dir is not None:
        candidates += [Path(model_dir) / name, Path(model_dir)]
    source = getattr(getattr(module, "config", None), "_name_or_path", None) or getattr(module, "name_or_path", None)
    if source:
        candidates += [Path(source), Path(source) / name]
    for folder in candidates:
        if folder.is_dir() and any(folder.glob("*.safetensors")):
            return _FolderWeights(MappedSafetensors(folder), module)
    raise MemfitError(
        f"Component {name!r} has no safetensors files to map for the disk tier (looked in "
        f"{[str(c) for c in candidates] or 'nothing: its config has no _name_or_path'}). Load the pipeline "
        "with from_pretrained from a saved folder, or pass model_dir= the pipeline folder."
    )


def in_memory_only(module: torch.nn.Module) -> frozenset[str]:
    """The live names of ``module``'s tensors that are in no file: those a single-file conversion computed."""
    places = file_places(module)
    return places.materialized if places is not None else frozenset()
