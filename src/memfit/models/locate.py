"""What ``--model`` names, from its path alone: a checkpoint file or a model folder, and whether it exists.

Nothing here imports torch, so the CLI refuses a missing model at once, with the sentence that opening
it would give (memfit.models.folder, memfit.models.single_file), instead of after seconds of imports.
"""

from __future__ import annotations

from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["PICKLE_SUFFIXES", "is_single_file", "refuse_missing_model"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def is_single_file(path: str | Path) -> bool:
    """Whether ``path`` names a checkpoint file (safetensors, GGUF or pickle) rather than a model folder."""
    path = Path(path).expanduser()
    return path.suffix in (".safetensors", ".gguf", *PICKLE_SUFFIXES) and not path.is_dir()


def refuse_missing_model(path: str | Path) -> None:
    """Refuse a model ``path`` that does not exist, in the words for a checkpoint file or a model folder."""
    path = Path(path).expanduser()
    if path.exists():
        return
    if is_single_file(path):
        raise MemfitError(f"Checkpoint {path} does not exist; pass an all-in-one .safetensors file or a diffusers "
                          "model folder.")
    raise MemfitError(f"Model folder {path} does not exist; pass the folder that holds model_index.json.")
