"""A diffusers model folder: validated up front, read without weights, loaded one stage at a time.

Everything that can be wrong with a folder (missing, not a diffusers layout, unsupported pipeline,
truncated or corrupt safetensors) is found here, before any work starts, and reported as one
sentence naming the file.
"""

from __future__ import annotations

import json
from functools import cached_property
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.safetensors_header import check_complete
from memfit.models.families import PipelineAdapter, adapter_for

def dtype_keyword() -> str:
    # diffusers renamed from_pretrained's torch_dtype to dtype (0.42) and warns on the old name.
    import diffusers.utils.deprecation_utils as deprecation

    return "dtype" if hasattr(deprecation, "_TORCH_DTYPE_DEPRECATION_MESSAGE") else "torch_dtype"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise MemfitError(f"Unknown dtype {name!r}; use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MemfitError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}); restore it from the original model.") from None


def check_safetensors(path: Path) -> None:
    """Raise MemfitError if `path` is not a complete safetensors file (header parse + exact size)."""
    check_complete(path)


_DTYPE_KWARG = ""


@dataclass
class ModelFolder:
    path: Path
    class_name: str
    components: dict[str, tuple[str, str]]  # name -> (library, class), only those present
    configs: dict[str, dict] = field(default_factory=dict)
    # Recommended settings shipped with a model (memfit_defaults.json): steps, guidance, width, height.
    defaults: dict = field(default_factory=dict)
    _fingerprints: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | Path) -> "ModelFolder":
        path = Path(path).expanduser()
        if not path.exists():
            raise MemfitError(f"Model folder {path} does not exist; pass the folder that holds model_index.json.")
        if not path.is_dir():
            raise MemfitError(f"{path} is a file, not a model folder; pass the diffusers folder that holds model_index.json.")
        index_path = path / "model_index.json"
        if not index_path.is_file():
            raise MemfitError(
                f"{path} is not a diffusers model folder (no model_index.json); "
                "save the pipeline with pipe.save_pretrained(folder) or download the diffusers version of the model."
            )
        index = _read_json(index_path)
        class_name = index.get("_class_name")
        if not isinstance(class_name, str):
            raise MemfitError(f"{index_path} has no _class_name; it is not a diffusers pipeline index.")
        components = {
            name: tuple(value)
            for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] is not None
        }
        configs = {}
        for name in components:
            for config_name in ("config.json", "scheduler_config.json"):
                config_path = path / name / config_name
                if config_path.is_file():
                    configs[name] = _read_json(config_path)
        defaults_path = path / "memfit_defaults.json"
        defaults = _read_json(defaults_path) if defaults_path.is_file() else {}
        return cls(path, class_name, components, configs, defaults)

    def component_fingerprint(self, name: str) -> str:
        """Content fingerprint of one component's folder (memfit.cache.fingerprint): hashed once per folder object."""
        if name not in self._fingerprints:
            from memfit.cache.fingerprint import fingerprint_folder

            self._fingerprints[name] = fingerprint_folder(self.path / name)
        return self._fingerprints[name]

    @cached_property
    def text_fingerprint(self) -> str:
        """Content fingerprint of the text encoders and tokenizers together."""
        from memfit.cache.fingerprint import combine_fingerprints

        names = [name for name in self.adapter.text_encoders if name in self.components]
        return combine_fingerprints(self.component_fingerprint(name) for name in names)

    @cached_property
    def adapter(self) -> PipelineAdapter:
        """The family's description (memfit.models.families); a class without one gets the generic adapter."""
        return adapter_for(self.class_name, self.configs, self.components)

    def require_configs(self, names) -> None:
        """Raise, naming the file, if a component in ``names`` has no config.json (planning needs it)."""
        for name in names:
            if name not in self.configs:
                library, class_name = self.components[name]
                raise MemfitError(
                    f"{self.path / name / 'config.json'} does not exist but model_index.json lists {name!r} as "
                    f"{library}.{class_name}; copy the component's config.json there (weights are not needed)."
                )

    def check_weights(self, names) -> None:
        for name in names:
            folder = self.path / name
            if name not in self.components:
                continue
            if not folder.is_dir():
                raise MemfitError(f"Component {name!r} is listed in model_index.json but {folder} is missing.")
            for weights in sorted(folder.glob("*.safetensors")):
                check_safetensors(weights)

    def load_stage(self, names, dtype: torch.dtype, device: torch.device, *, pipeline_class: str | None = None,
                   external: dict[str, Path] | None = None):
        """The pipeline with only `names` loaded; every other component is None (not resident).

        ``pipeline_class`` loads the folder's components as another diffusers pipeline class (the
        img2img, inpaint or ControlNet pipeline of the family). ``external`` maps a component name in
        ``names`` to a model folder of its own (``--controlnet DIR``), loaded with its config's class.
        """
        import diffusers

        global _DTYPE_KWARG
        _DTYPE_KWARG = _DTYPE_KWARG or dtype_keyword()
        external = {name: folder for name, folder in (external or {}).items() if name in names}
        self.check_weights([name for name in names if name not in external])
        pipeline_class = getattr(diffusers, pipeline_class or self.class_name)
        skipped = {name: None for name in self.components if name not in names}
        try:
            modules = {name: load_component(folder, dtype) for name, folder in external.items()}
            pipe = pipeline_class.from_pretrained(self.path, **{_DTYPE_KWARG: dtype}, **skipped, **modules)
        except MemfitError:
            raise
        except Exception as exc:  # diffusers raises many types; name the folder and the stage
            raise MemfitError(
                f"Could not load {', '.join(names)} from {self.path}: {type(exc).__name__}: {exc}"
            ) from exc
        pipe.set_progress_bar_config(disable=True)
        # Attributes the pipeline derives from components that are not loaded in this stage.
        if "vae" in self.configs and "vae" not in names:
            pipe.vae_scale_factor = self.adapter.vae_scale_factor()
        return pipe.to(device)


def load_component(path: str | Path, dtype: torch.dtype):
    """A diffusers model saved on its own (a ControlNet folder), as the class its config.json names."""
    import diffusers

    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.is_file():
        raise MemfitError(f"{path} is not a diffusers model folder (no config.json); pass the folder that "
                          "save_pretrained wrote for the model, e.g. --controlnet ./my-controlnet.")
    class_name = _read_json(config_path).get("_class_name")
    model_class = getattr(diffusers, class_name or "", None)
    if model_class is None:
        raise MemfitError(f"{config_path} names no diffusers model class ({class_name!r}).")
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights)
    global _DTYPE_KWARG
    _DTYPE_KWARG = _DTYPE_KWARG or dtype_keyword()
    return model_class.from_pretrained(path, **{_DTYPE_KWARG: dtype})
