"""What ``--model`` names: a diffusers model folder, or an all-in-one single-file checkpoint."""

from __future__ import annotations

from pathlib import Path

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, is_single_file

__all__ = ["open_model_path"]


def open_model_path(path: str | Path, *, config: str | Path | None = None, allow_pickle: bool = False) -> ModelFolder:
    """The model at ``path``: a ModelFolder, or for a checkpoint file a SingleFileModel with its configs from
    ``config`` (a diffusers folder of its family) or where memfit finds them (memfit.models.single_file_configs)."""
    if is_single_file(path):
        return SingleFileModel.open_file(path, config=config, allow_pickle=allow_pickle)
    if config is not None:
        raise MemfitError(f"--config is for a single-file checkpoint, but {path} is a diffusers model folder, which "
                          "holds its own configs; leave --config out.")
    return ModelFolder.open(path)
