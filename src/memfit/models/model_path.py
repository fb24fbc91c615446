"""What ``--model`` names: a diffusers model folder, or an all-in-one single-file checkpoint."""

from __future__ import annotations

from pathlib import Path

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.locate import is_single_file
from memfit.models.single_file import SingleFileModel

__all__ = ["open_model_path", "with_components"]


def open_model_path(path: str | Path, *, config: str | Path | None = None, allow_pickle: bool = False,
                    components: dict[str, str | Path] | None = None, quantize: dict[str, str] | None = None,
                    plan_only: bool = False) -> ModelFolder:
    """The model at ``path``: a ModelFolder, or for a checkpoint file a SingleFileModel with its configs from
    ``config`` (a diffusers folder of its family) or where memfit finds them (memfit.models.single_file_configs).
    ``components`` (name -> file) replaces those components by single files of their own (with_components);
    ``quantize`` (name -> type) quantizes those on the fly (memfit.models.quantize), or with ``plan_only`` only
    sizes them so (nothing written)."""
    if is_single_file(path):
        model = SingleFileModel.open_file(path, config=config, allow_pickle=allow_pickle,
                                          paired="transformer_2" in (components or {}))
    elif config is not None:
        raise MemfitError(f"--config is for a single-file checkpoint, but {path} is a diffusers model folder, which "
                          "holds its own configs; leave --config out.")
    else:
        model = ModelFolder.open(path)
    model = with_components(model, components, allow_pickle=allow_pickle)
    if plan_only:
        from memfit.models.quantize import plan_quantized

        return plan_quantized(model, quantize)
    return with_components(model, None, allow_pickle=allow_pickle, quantize=quantize)


def with_components(model: ModelFolder, components: dict[str, str | Path] | None, *,
                    allow_pickle: bool = False, quantize: dict[str, str] | None = None) -> ModelFolder:
    """``model`` with the components named in ``components`` read from the files given for them (SingleFileModel.
    with_components), then those of ``quantize`` quantized (memfit.models.quantize); ``model`` itself when there
    are none."""
    if quantize:
        from memfit.models.quantize import with_quantized

        model = with_components(model, components, allow_pickle=allow_pickle)
        model.check_layout()
        return with_quantized(model, quantize, allow_pickle=allow_pickle)
    if not components:
        return model
    if not isinstance(components, dict):
        raise MemfitError(f"components must map a component name to a file, e.g. {{'vae': 'vae.safetensors'}}; got "
                          f"{components!r}.")
    model.check_layout()
    return SingleFileModel.with_components(model, components, allow_pickle=allow_pickle)
