"""LoRA adapters on a stage's pipeline, with diffusers' own ``load_lora_weights``.

A staged run loads only some of a pipeline's components at a time (text encoders, then the
denoiser), but diffusers' ``load_lora_weights`` loads into the denoiser and the text encoders
together and fails on a component that is None. While it runs, each LoRA-loadable component this
stage did not load is stood in for by ``_NotLoaded``, which takes no adapter; the file's keys for
it are simply not used in this stage (the stage that loads it uses them). The adapters stay
unfused (PEFT layers beside the original weights, scaled by ``set_adapters``), exactly as plain
diffusers runs them, so the images are the same bit for bit. The original weights are then still
the file's, so they may stream from disk; the LoRA's own tensors are not in the model's files and
stay in memory (memfit.run.executor keeps them off the disk tier).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from memfit.errors import MemfitError

__all__ = ["check_loras", "load_loras", "parse_lora", "ADAPTER_PARAMETER_NAMES"]

# The parameter names PEFT gives a LoRA's own tensors (module path segments): they are in no model file.
ADAPTER_PARAMETER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def parse_lora(spec: str) -> tuple[str, float]:
    """``PATH[:SCALE]`` (the --lora flag) as (path, scale); the scale defaults to 1."""
    path, _, scale = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not path:
        path, scale = spec, ""
    try:
        value = float(scale) if scale else 1.0
    except ValueError:
        # A colon that is part of the path (C:\\...), with no scale after it.
        path, value = spec, 1.0
    return path, value


def check_loras(loras) -> tuple[tuple[str, float], ...]:
    """(path, scale) pairs, each path an existing LoRA file or folder; raises naming the flag otherwise."""
    checked = []
    for item in loras or ():
        path, scale = parse_lora(item) if isinstance(item, str) else (str(item[0]), float(item[1]))
        if not Path(path).expanduser().exists():
            raise MemfitError(f"--lora {path}: no such file; pass a LoRA .safetensors file (PATH or PATH:SCALE).")
        checked.append((str(Path(path).expanduser()), scale))
    return tuple(checked)


class _NotLoaded:
    """Stands in, while LoRA weights load, for a LoRA-loadable component this stage does not load."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, config):
        # Its config, from the folder: SDXL's loader reads the UNet's to convert non-diffusers LoRA formats.
        self.config = config

    def load_lora_adapter(self, *args, **kwargs):  # diffusers models (denoisers)
        return None

    def load_adapter(self, *args, **kwargs):  # transformers models (text encoders)
        return None

    def named_modules(self, *args, **kwargs):
        return iter(())

    def modules(self):
        return iter(())

    def to(self, *args, **kwargs):
        return self


@contextlib.contextmanager
def _stand_ins(pipe, configs):
    from diffusers.configuration_utils import FrozenDict

    absent = [name for name in getattr(pipe, "_lora_loadable_modules", ()) if getattr(pipe, name, None) is None]
    for name in absent:
        # not through __setattr__, which would rewrite the pipeline's config
        vars(pipe)[name] = _NotLoaded(FrozenDict(configs.get(name, {})))
    try:
        yield
    finally:
        for name in absent:
            vars(pipe)[name] = None


def load_loras(pipe, loras: tuple[tuple[str, float], ...], configs: dict[str, dict]) -> list[str]:
    """Load each (path, scale) into the components ``pipe`` has loaded; returns the adapter names.

    ``configs``: the folder's component configs, for the stand-ins of components not loaded."""
    if not loras:
        return []
    if not hasattr(pipe, "load_lora_weights"):
        raise MemfitError(f"{type(pipe).__name__} takes no LoRA (diffusers has no load_lora_weights for it); leave out --lora.")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise MemfitError("--lora needs the peft package (diffusers loads LoRAs with it): pip install memfit[lora].")
    names = []
    with _stand_ins(pipe, configs):
        for index, (path, _) in enumerate(loras):
            name = f"memfit_lora_{index}"
            file = Path(path)
            try:
                if file.is_file():
                    pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=name)
                else:
                    pipe.load_lora_weights(str(file), adapter_name=name)
            except Exception as exc:  # diffusers and peft raise many types for a file that does not fit
                raise MemfitError(f"--lora {path} does not load into {type(pipe).__name__}: {type(exc).__name__}: {exc}") from exc
            names.append(name)
    loaded = [name for name in names if _has_adapter(pipe, name)]
    if loaded:
        with _stand_ins(pipe, configs):
            pipe.set_adapters(loaded, adapter_weights=[scale for name, (_, scale) in zip(names, loras) if name in loaded])
    return loaded


def _has_adapter(pipe, name: str) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for component in getattr(pipe, "_lora_loadable_modules", ()):
        module = getattr(pipe, component, None)
        if isinstance(module, torch.nn.Module) and any(
                isinstance(m, BaseTunerLayer) and name in m.scaling for m in module.modules()):
            return True
    return False
