"""A diffusers model folder: validated up front, read without weights, loaded one stage at a time.

Everything that can be wrong with a folder (missing, not a diffusers layout, unsupported pipeline,
a missing component folder or config.json, a component naming code to import, pickle weights,
truncated or corrupt safetensors) is found here, before any work starts, and reported as one
sentence naming the file. Once a stage's components are loaded their weights are held to their
checkpoint: a tensor the model needs but the files lack (diffusers would leave it uninitialised),
one the model does not have, one of a stray dtype or a wrong shape is an error naming the key and
the file, never a wrong image.
"""

from __future__ import annotations

import json
import os
import re
from functools import cached_property
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.models.checkpoint_keys import loaded_names
from memfit.models.locate import PICKLE_SUFFIXES, refuse_missing_model
from memfit.safetensors_header import check_complete
from memfit.models.families import PipelineAdapter, adapter_for

def dtype_keyword() -> str:
    # diffusers renamed from_pretrained's torch_dtype to dtype (0.42) and warns on the old name.
    import diffusers.utils.deprecation_utils as deprecation

    return "dtype" if hasattr(deprecation, "_TORCH_DTYPE_DEPRECATION_MESSAGE") else "torch_dtype"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MemfitError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}); restore it from the original model.") from None


def check_safetensors(path: Path) -> None:
    """Raise MemfitError if `path` is not a complete safetensors file (header parse + exact size)."""
    check_complete(path)


# The libraries whose classes memfit loads, besides diffusers' own pipeline packages (memfit.plan.meta.diffusers_module).
# Any other name in model_index.json is a module to import (code shipped with or named by the model): memfit never
# runs code from a model folder.
LIBRARIES = ("diffusers", "transformers")
_CONVERT = ("convert it to safetensors: python -c \"import torch, safetensors.torch as s; "
            "s.save_file(torch.load('{src}', weights_only=True), '{dst}')\"")


# What diffusers and transformers call the safetensors file that replaces a pickle one.
_SAFETENSORS_NAMES = {"pytorch_model": "model", "diffusion_pytorch_model": "diffusion_pytorch_model"}


def load_pickle(path: Path):
    """``path`` through torch's weights_only loader: memory-mapped when it is torch's zip format,
    read whole when it is the legacy format (mmap cannot read that)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def pickle_refused(src: Path, dst: Path) -> str:
    """The sentence that refuses the pickle checkpoint ``src`` without allow_pickle, converting it to ``dst``."""
    return (f"{src} is a pickle checkpoint, which memfit does not load by default (pickle can run code); "
            + _CONVERT.format(src=src, dst=dst) + ", or pass --allow-pickle to load it with torch's weights_only loader.")


def load_tensors_only(path: Path):
    """What torch's weights_only loader reads from ``path`` (tensors and plain containers, no code); raises
    naming the file when it holds anything else."""
    try:
        return load_pickle(path)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, ... all mean: not plain tensors
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MemfitError(
            f"{path} is not a plain tensor checkpoint ({reason}); memfit loads pickle files only with torch's "
            "weights_only loader and never runs code from them; get the model in safetensors format instead."
        ) from None


def _needs_config(class_name: str) -> bool:
    """Tokenizers and processors keep their own files; every model, scheduler and guider has a config."""
    return not any(word in class_name for word in ("Tokenizer", "Processor", "FeatureExtractor"))


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files diffusers loads from a component folder (variants such as .fp16 only
    when there is no plain file)."""
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if "." not in f.stem]
    return plain or files


def _checkpoint_entries(files: list[Path]) -> dict[str, tuple[str, list[int], Path]]:
    """tensor name -> (dtype, shape, file) over a component's weights files, read without loading data."""
    from memfit.safetensors_header import read_header

    entries = {}
    for path in files:
        if path.suffix == ".safetensors":
            for key, entry in read_header(path).entries.items():
                entries[key] = (_SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]), list(entry["shape"]), path)
        else:  # pickle, only with allow_pickle; weights_only never runs code from the file
            state = load_pickle(path)
            for key, tensor in state.items():
                if isinstance(tensor, torch.Tensor):
                    entries[key] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), path)
    return entries


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
_CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _matches_any(key: str, patterns) -> bool:
    return any(re.search(pattern, key) for pattern in patterns or ())


def check_loaded_weights(module: torch.nn.Module, name: str, folder: Path, files: list[Path]) -> None:
    """Raise, naming the key and the file, unless ``module``'s weights are exactly its checkpoint's.

    Missing tensors (left uninitialised by diffusers, with a warning memfit's quiet logging hides),
    unexpected ones (a checkpoint for another config) and floating tensors in a dtype the rest of
    the checkpoint does not use (fp32 kept by the model's ``_keep_in_fp32_modules`` excepted).
    """
    if not files:
        return
    check_weight_entries(module, name, folder, _checkpoint_entries(files), files[0] if len(files) == 1 else folder)


def check_weight_entries(module: torch.nn.Module, name: str, folder: Path, stored: dict[str, tuple[str, list[int], Path]],
                         where: Path, *, one_dtype: bool = True) -> None:
    """check_loaded_weights for ``stored`` (tensor name -> (dtype, shape, file)); ``where`` names the weights
    in messages, ``folder`` the component's config folder. ``one_dtype``: refuse a stray floating dtype."""
    names = loaded_names(module, stored)
    if names is None:
        entries, state = stored, None  # names not comparable: only the dtype check applies
    else:
        entries = {names[key]: value for key, value in stored.items()}
        state = module.state_dict(keep_vars=True)
    cls = type(module).__name__
    by_tensor: dict[int, list[str]] = {}
    for key, tensor in (state or {}).items():
        by_tensor.setdefault(id(tensor), []).append(key)
    ignore_missing = getattr(module, "_keys_to_ignore_on_load_missing", None)
    missing = sorted(keys[0] for keys in by_tensor.values()
                     if not any(k in entries for k in keys) and not any(_matches_any(k, ignore_missing) for k in keys))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MemfitError(
            f"{where} has no tensor {missing[0]!r}{more}, which {name} ({cls}) needs, so it would run with "
            "uninitialised weights; re-download or re-save the model."
        )
    ignore_unexpected = getattr(module, "_keys_to_ignore_on_load_unexpected", None)
    # Buffers the model does not save (CLIP's position_ids) may be in older checkpoints: never unexpected.
    known = set(state or ()) | {key for key, _ in module.named_buffers()}
    unexpected = sorted(k for k in entries if state is not None and k not in known
                        and not _matches_any(k, ignore_unexpected))
    if unexpected and os.environ.get("MEMFIT_ALLOW_EXTRA_KEYS", "").strip().lower() not in ("1", "yes", "true", "on"):
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise MemfitError(
            f"{entries[unexpected[0]][2]} holds tensor {unexpected[0]!r}{more}, which {name} ({cls}) does not have; "
            f"the weights are for another model or config: check {folder / 'config.json'} or re-download the model "
            "(MEMFIT_ALLOW_EXTRA_KEYS=1 loads it anyway)."
        )
    if not one_dtype:
        return
    keep_fp32 = getattr(module, "_keep_in_fp32_modules", None) or []
    counts: dict[str, int] = {}
    for dtype, _, _ in entries.values():
        if dtype in _FLOAT_DTYPES:
            counts[dtype] = counts.get(dtype, 0) + 1
    if len(counts) > 1:
        main = max(counts, key=counts.get)
        for key, (dtype, _, path) in sorted(entries.items()):
            if dtype in _FLOAT_DTYPES and dtype != main:
                if dtype == "float32" and any(part in keep_fp32 for part in key.split(".")):
                    continue
                raise MemfitError(
                    f"{path} stores tensor {key!r} as {dtype} but the rest of {name} as {main}; re-save the "
                    f"component in one dtype (e.g. load it and save it again with {name}.to(torch.{main}))."
                )


# diffusers words a shape mismatch two ways: torch's load_state_dict (copying ... from checkpoint), and
# its own loader into meta tensors when accelerate is installed (expected shape ..., but got ...).
_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) "
                            r"from checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))")
_SIZE_MISMATCH_META = re.compile(r"because ([\w.]+) expected shape (torch\.Size\(\[[^\]]*\]\)), "
                                 r"but got (torch\.Size\(\[[^\]]*\]\))")


_DTYPE_KWARG = ""


def _shape_of(text: str) -> list[int]:
    """[1, 2] from diffusers' "torch.Size([1, 2])"."""
    return [int(n) for n in re.findall(r"\d+", text)]


def size_mismatch(exc: BaseException) -> tuple[str, list[int], list[int]] | None:
    """(tensor name, stored shape, shape the config needs) when loading failed on a tensor of another shape."""
    mismatch = _SIZE_MISMATCH.search(str(exc))
    if mismatch:
        key, stored, needed = mismatch.groups()
    else:
        meta_mismatch = _SIZE_MISMATCH_META.search(str(exc))
        if not meta_mismatch:
            return None
        key, needed, stored = meta_mismatch.groups()
    return key, _shape_of(stored), _shape_of(needed)


@dataclass
class ModelFolder:
    path: Path
    class_name: str
    components: dict[str, tuple[str, str]]  # name -> (library, class), only those present
    configs: dict[str, dict] = field(default_factory=dict)
    # Recommended settings shipped with a model (memfit_defaults.json): steps, guidance, width, height.
    defaults: dict = field(default_factory=dict)
    _fingerprints: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # Load pickle checkpoints (.bin, .pt, ...) with torch's weights_only loader; refused by default.
    allow_pickle: bool = False

    @classmethod
    def open(cls, path: str | Path) -> "ModelFolder":
        path = Path(path).expanduser()
        refuse_missing_model(path)
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
            for config_name in ("config.json", "scheduler_config.json", "guider_config.json"):
                config_path = path / name / config_name
                if config_path.is_file():
                    configs[name] = _read_json(config_path)
        defaults_path = path / "memfit_defaults.json"
        defaults = _read_json(defaults_path) if defaults_path.is_file() else {}
        return cls(path, class_name, components, configs, defaults)

    @property
    def config_folder(self) -> Path:
        """The diffusers folder whose model_index.json, configs, scheduler and tokenizers the model uses, and
        whose component folders hold the weights of the components not loaded apart (see _load_apart)."""
        return self.path

    @property
    def model_components(self) -> dict[str, tuple[str, str]]:
        """{name: (library, class name)} of the components that hold weights (not tokenizers or schedulers)."""
        from memfit.plan.meta import is_model_class

        return {name: value for name, value in self.components.items() if is_model_class(*value)}

    def listed_model_components(self) -> str:
        """The components that hold weights, with their classes, for a sentence: "unet (UNet2DConditionModel), ..."."""
        return ", ".join(f"{name} ({class_name})" for name, (_, class_name) in self.model_components.items())

    def component_fingerprint(self, name: str) -> str:
        """Content fingerprint of one component's folder (memfit.cache.fingerprint): hashed once per folder object."""
        if name not in self._fingerprints:
            from memfit.cache.fingerprint import fingerprint_folder

            self._fingerprints[name] = fingerprint_folder(self.config_folder / name)
        return self._fingerprints[name]

    def describe_source(self) -> str:
        """Where the model's parts came from, for the run report; empty for a folder (it is all there)."""
        return ""

    @cached_property
    def text_fingerprint(self) -> str:
        """Content fingerprint of the text encoders and tokenizers together."""
        from memfit.cache.fingerprint import combine_fingerprints

        names = [name for name in self.adapter.text_encoders if name in self.components]
        return combine_fingerprints(self.component_fingerprint(name) for name in names)

    @cached_property
    def fingerprint(self) -> str:
        """Content fingerprint of the whole model: every component's (as the cache keys it) by name, and the
        pipeline index and recommended settings (memfit_defaults.json), which decide what it draws too."""
        from memfit.cache.fingerprint import combine_fingerprints

        index = (self.config_folder / "model_index.json").read_text(encoding="utf-8")
        parts = [f"{name}:{self.component_fingerprint(name)}" for name in self.components]
        return combine_fingerprints([*parts, f"index:{index}", f"defaults:{json.dumps(self.defaults, sort_keys=True)}"])

    @cached_property
    def adapter(self) -> PipelineAdapter:
        """The family's description (memfit.models.families); a class without one gets the generic adapter."""
        adapter = adapter_for(self.class_name, self.configs, self.components)
        index = _read_json(self.config_folder / "model_index.json")
        adapter.pipeline_options = {name: value for name, value in index.items()
                                    if not name.startswith("_") and name not in self.components
                                    and not isinstance(value, list)}
        return adapter

    def check_layout(self) -> None:
        """Raise, naming the file, if the pipeline or a listed component cannot be loaded: diffusers has no such
        pipeline class, a component's folder or config.json is missing, or model_index.json names code to import
        rather than a diffusers or transformers class."""
        import diffusers

        index = self.config_folder / "model_index.json"
        if getattr(diffusers, self.class_name, None) is None:
            raise MemfitError(
                f"{index} names the pipeline class {self.class_name!r}, which diffusers {diffusers.__version__} does "
                "not have; use a folder saved by diffusers' save_pretrained (a class newer than this diffusers needs "
                "a newer diffusers)."
            )
        from memfit.plan.meta import diffusers_module

        for name, (library, class_name) in self.components.items():
            if library not in LIBRARIES and diffusers_module(library) is None:
                raise MemfitError(
                    f"{index} names {library}.{class_name} for {name!r}, code that would have to be imported from the "
                    f"model; memfit never runs code from a model folder, so use a model whose components are "
                    f"{' or '.join(LIBRARIES)} classes."
                )
            folder = self.config_folder / name
            if not folder.is_dir():
                raise MemfitError(
                    f"Component {name!r} is listed in model_index.json but {folder} is missing; "
                    "restore that folder from the original model."
                )
            if _needs_config(class_name) and name not in self.configs:
                raise MemfitError(
                    f"{folder / 'config.json'} does not exist but model_index.json lists {name!r} as "
                    f"{library}.{class_name}; restore it from the original model."
                )
            if (self.configs.get(name) or {}).get("auto_map"):
                raise MemfitError(
                    f"{folder / 'config.json'} maps {name!r} to code shipped with the model (auto_map); memfit never "
                    "runs code from a model folder, so use a model whose components are diffusers or transformers classes."
                )

    def require_configs(self, names) -> None:
        """Raise, naming the file, if a component in ``names`` has no config.json (planning needs it)."""
        for name in names:
            if name not in self.configs:
                library, class_name = self.components[name]
                raise MemfitError(
                    f"{self.config_folder / name / 'config.json'} does not exist but model_index.json lists {name!r} as "
                    f"{library}.{class_name}; copy the component's config.json there (weights are not needed)."
                )

    def check_weights(self, names) -> None:
        for name in names:
            folder = self.config_folder / name
            if name not in self.components:
                continue
            if not folder.is_dir():
                raise MemfitError(f"Component {name!r} is listed in model_index.json but {folder} is missing.")
            safetensors = sorted(folder.glob("*.safetensors"))
            for weights in safetensors:
                check_safetensors(weights)
            pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles and not safetensors and not self.allow_pickle:
                src = pickles[0]
                raise MemfitError(pickle_refused(src, src.with_name(_SAFETENSORS_NAMES.get(src.stem, src.stem) + ".safetensors")))
            if pickles and not safetensors:
                for src in pickles:
                    load_tensors_only(src)

    def weight_files(self, name: str) -> list[Path]:
        """The checkpoint files of component ``name`` that loading it reads."""
        folder = self.config_folder / name
        files = _weight_files(folder)
        if not files and self.allow_pickle:
            files = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        return files

    def file_dtype(self, name: str) -> torch.dtype | None:
        """The one floating dtype component ``name``'s safetensors files store its weights in (None when
        it has no safetensors files or more than one floating dtype)."""
        files = [f for f in self.weight_files(name) if f.suffix == ".safetensors"]
        if not files:
            return None
        found = {dtype for dtype, _, _ in _checkpoint_entries(files).values() if dtype in _FLOAT_DTYPES}
        return getattr(torch, found.pop()) if len(found) == 1 else None

    def convertible(self, name: str, dtype: torch.dtype) -> bool:
        """Whether component ``name`` can load in its files' dtype and be converted to ``dtype`` by memfit
        with the values plain loading at ``dtype`` gives: its files hold one other floating dtype, and
        its class keeps no module in fp32 at ``dtype`` (diffusers keeps them at any dtype, transformers
        at fp16, or at bf16 too when strict)."""
        import importlib

        file_dtype = self.file_dtype(name)
        if file_dtype is None or file_dtype == dtype or file_dtype not in _CONVERTIBLE or dtype not in _CONVERTIBLE:
            return False
        from memfit.plan.meta import diffusers_module

        library, class_name = self.components.get(name, ("", ""))
        module = diffusers_module(library) or library
        try:
            cls = getattr(importlib.import_module(module), class_name)
        except (ImportError, AttributeError, ValueError):
            return False
        if module.startswith("diffusers") or dtype == torch.float16:
            return not getattr(cls, "_keep_in_fp32_modules", None)
        return not getattr(cls, "_keep_in_fp32_modules_strict", None)

    def load_stage(self, names, dtype: torch.dtype, device: torch.device | None = None, *,
                   pipeline_class: str | None = None, external: dict[str, Path] | None = None,
                   in_file_dtype=()):
        """The pipeline with only `names` loaded; every other component is None (not resident).

        The weights stay in host memory unless ``device`` names where to move the whole pipeline:
        a staged run (memfit.run.runner) loads on the host, plans, and moves only what the plan keeps
        on the device, so a stage larger than a GPU never has to fit on it whole.

        ``pipeline_class`` loads the folder's components as another diffusers pipeline class (the
        img2img, inpaint or ControlNet pipeline of the family). ``external`` maps a component name in
        ``names`` to a model folder of its own (``--controlnet DIR``), loaded with its config's class.
        The components named in ``in_file_dtype`` load in the dtype their files store (see file_dtype):
        their weights stay views of the memory-mapped files, and memfit.run.executor.optimize converts
        them to ``dtype`` block by block, so a conversion never holds the whole model twice. Components
        whose weights are single files are loaded by ``_load_apart`` and handed to diffusers as they are.
        """
        import diffusers

        global _DTYPE_KWARG
        _DTYPE_KWARG = _DTYPE_KWARG or dtype_keyword()
        external = {name: folder for name, folder in (external or {}).items() if name in names}
        self.check_weights([name for name in names if name not in external])
        apart = dict(self._load_apart([name for name in names if name not in external], dtype, in_file_dtype))
        apart.update(self.adapter.load_apart(self.config_folder, [name for name in names
                                                                  if name not in external and name not in apart]))
        own = [name for name in names if name not in external and name not in apart]
        pipeline_class = getattr(diffusers, pipeline_class or self.class_name)
        skipped = {name: None for name in self._index_components() if name not in names}
        stand_ins = {name: config_only_model(self.configs[name]) for name in self.adapter.read_at_init
                     if name in skipped and name in self.configs}
        try:
            modules = {name: load_component(folder, dtype) for name, folder in external.items()}
            dtypes = {name: self.file_dtype(name) for name in in_file_dtype if name in own}
            load_dtype = {"default": dtype, **dtypes} if dtypes else dtype
            pipe = pipeline_class.from_pretrained(self.config_folder, **{_DTYPE_KWARG: load_dtype},
                                                  **{**skipped, **stand_ins}, **modules, **apart)
            for name in stand_ins:  # not loaded in this stage, as every skipped component is
                setattr(pipe, name, None)
        except MemfitError:
            raise
        except Exception as exc:  # diffusers raises many types; name the folder and the stage
            mismatch = size_mismatch(exc)
            if mismatch:
                key, stored, needed = mismatch
                # diffusers names the class ("... in loading state_dict for UNet2DConditionModel")
                owners = [n for n in names if n in self.components and self.components[n][1] in str(exc)] or \
                    [n for n in names if n in self.components and self.weight_files(n)]
                files = ", ".join(str(f) for n in owners for f in self.weight_files(n)) or str(self.path)
                raise MemfitError(
                    f"Tensor {key!r} in {files} has shape {stored} where {owners[0] if owners else 'the model'}'s "
                    f"config needs {needed}; the weights do not belong to this config: re-download the model."
                ) from exc
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise MemfitError(
                f"Could not load {', '.join(names)} from {self.path}: {type(exc).__name__}: {first_line}"
            ) from exc
        for name in own:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                check_loaded_weights(module, name, self.config_folder / name, self.weight_files(name))
        return self._ready(pipe, names, device)

    def _index_components(self):
        """Every component model_index.json names: those a stage does not load are passed to diffusers as None."""
        return self.components

    def _load_apart(self, names, dtype: torch.dtype, in_file_dtype) -> dict[str, torch.nn.Module]:
        """The components of ``names`` whose weights are not in the folder, loaded by the model itself (a
        single-file checkpoint's; memfit.models.single_file): none for a folder."""
        return {}

    def _ready(self, pipe, names, device: torch.device | None):
        """A freshly loaded stage's pipeline, quiet, with what it derives from components not loaded."""
        pipe.set_progress_bar_config(disable=True)
        if "vae" in self.configs and "vae" not in names:
            pipe.vae_scale_factor = self.adapter.vae_scale_factor()
        return pipe if device is None else pipe.to(device)


def config_only_model(config: dict):
    """A weightless diffusers model whose config (and attributes) are ``config``: what a pipeline's __init__
    reads of a component a stage does not load (PipelineAdapter.read_at_init). A ModelMixin, since
    from_pretrained takes only a model in a model's place."""
    from diffusers import ModelMixin
    from diffusers.configuration_utils import ConfigMixin, FrozenDict

    model = type("ConfigOnlyModel", (ModelMixin, ConfigMixin), {"config_name": "config.json"})()
    model._internal_dict = FrozenDict(config)
    vars(model).update({key: value for key, value in config.items()
                        if not key.startswith("_") and not hasattr(type(model), key)})
    return model


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
