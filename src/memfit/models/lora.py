"""LoRA adapters on a stage's pipeline, with diffusers' own ``load_lora_weights``.

A staged run loads only some of a pipeline's components at a time (text encoders, then the
denoiser), but diffusers' ``load_lora_weights`` loads into the denoiser and the text encoders
together and fails on a component that is None. While it runs, each LoRA-loadable component this
stage did not load is stood in for by ``_NotLoaded``, which takes no adapter, and diffusers'
``load_lora_into_text_encoder`` skips a text encoder that is one (it would size the adapter from the
encoder's modules first); the file's keys for it are simply not used in this stage (the stage that
loads it uses them). A file with weights for no component of the pipeline (a LoRA for another
family) is refused, naming the file and the pipeline. The adapters stay
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
    """Stands in, while LoRA weights load, for a LoRA-loadable component this stage does not load.

    ``offered`` names the adapters whose file had weights for it: those the stage that loads it takes."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, config):
        # Its config, from the folder: SDXL's loader reads the UNet's to convert non-diffusers LoRA formats.
        self.config = config
        self.offered: set[str] = set()

    def load_lora_adapter(self, state_dict, *args, prefix="transformer", adapter_name=None, **kwargs):  # denoisers
        # As diffusers' own load_lora_adapter: the keys under the component's prefix are its weights.
        if any(prefix is None or key.startswith(f"{prefix}.") for key in state_dict):
            self.offered.add(adapter_name)

    def named_modules(self, *args, **kwargs):
        return iter(())

    def modules(self):
        return iter(())

    def state_dict(self, *args, **kwargs):  # Flux's loader reads the transformer's to pad LoRA shapes
        return {}

    def to(self, *args, **kwargs):
        return self


@contextlib.contextmanager
def _stand_ins(pipe, configs):
    """While the block runs, a _NotLoaded for each LoRA-loadable component ``pipe`` lacks; yields them."""
    from diffusers.configuration_utils import FrozenDict

    absent = [name for name in getattr(pipe, "_lora_loadable_modules", ()) if getattr(pipe, name, None) is None]
    stand_ins = [_NotLoaded(FrozenDict(configs.get(name, {}))) for name in absent]
    # not through __setattr__, which would rewrite the pipeline's config
    replaced = dict(zip(absent, stand_ins))
    if hasattr(pipe, "load_lora_into_text_encoder"):
        replaced["load_lora_into_text_encoder"] = _loader_skipping_stand_ins(pipe)
    vars(pipe).update(replaced)
    try:
        yield stand_ins
    finally:
        for name in absent:
            vars(pipe)[name] = None
        vars(pipe).pop("load_lora_into_text_encoder", None)


def _loader_skipping_stand_ins(pipe):
    """``pipe``'s load_lora_into_text_encoder, which for a _NotLoaded text encoder only notes whether the file has
    weights for it (the keys under its prefix, as diffusers selects them)."""
    original = pipe.load_lora_into_text_encoder

    def load_lora_into_text_encoder(state_dict, *args, text_encoder=None, prefix=None, adapter_name=None, **kwargs):
        if not isinstance(text_encoder, _NotLoaded):
            return original(state_dict, *args, text_encoder=text_encoder, prefix=prefix, adapter_name=adapter_name,
                            **kwargs)
        prefix = prefix or pipe.text_encoder_name
        if any(key.startswith(f"{prefix}.") for key in state_dict):
            text_encoder.offered.add(adapter_name)
        return None

    return load_lora_into_text_encoder


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
    from memfit.quant.layers import logical_weights

    names = []
    modules = [module for module in pipe.components.values() if isinstance(module, torch.nn.Module)]
    with _stand_ins(pipe, configs) as stand_ins, logical_weights(modules):
        for index, (path, _) in enumerate(loras):
            name = f"memfit_lora_{index}"
            file = Path(path)
            try:
                with _failures_not_logged():
                    _load_file(pipe, file, name)
            except Exception as exc:  # diffusers and peft raise many types for a file that does not fit
                if _matches_no_module(exc):
                    raise MemfitError(_for_another_family(path, pipe)) from exc
                reason = " ".join(str(exc).split())
                reason = reason if len(reason) <= 300 else reason[:300] + "..."
                raise MemfitError(f"--lora {path} does not load into {type(pipe).__name__}: "
                                  f"{type(exc).__name__}: {reason}") from exc
            if not _has_adapter(pipe, name) and not any(name in stand_in.offered for stand_in in stand_ins):
                raise MemfitError(_for_another_family(path, pipe))
            names.append(name)
    loaded = [name for name in names if _has_adapter(pipe, name)]
    if loaded:
        with _stand_ins(pipe, configs):
            pipe.set_adapters(loaded, adapter_weights=[scale for name, (_, scale) in zip(names, loras) if name in loaded])
    return loaded


def _load_file(pipe, file: Path, name: str) -> None:
    if file.is_file():
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=name)
    else:
        pipe.load_lora_weights(str(file), adapter_name=name)


@contextlib.contextmanager
def _failures_not_logged():
    """diffusers logs a LoRA that fails to load as an error before raising; memfit says it once, in its own words."""
    import logging

    logger = logging.getLogger("diffusers.loaders.peft")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _matches_no_module(exc: Exception) -> bool:
    """Whether peft refused a LoRA because none of its layers names a module of the model."""
    try:
        from peft.utils.error import NoMatchingPeftModuleError
    except ImportError:  # an older peft: its message says so
        return "not found in the base model" in str(exc)
    return isinstance(exc, NoMatchingPeftModuleError)


def _for_another_family(path: str, pipe) -> str:
    components = ", ".join(getattr(pipe, "_lora_loadable_modules", ()))
    return (f"--lora {path} has no weights for any module of {type(pipe).__name__} ({components}): it is a LoRA for "
            "another model family; pass a LoRA made for this model's family.")


def _has_adapter(pipe, name: str) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for component in getattr(pipe, "_lora_loadable_modules", ()):
        module = getattr(pipe, component, None)
        if isinstance(module, torch.nn.Module) and any(
                isinstance(m, BaseTunerLayer) and name in m.scaling for m in module.modules()):
            return True
    return False
