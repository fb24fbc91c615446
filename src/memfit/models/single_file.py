"""An all-in-one single-file checkpoint (AUTOMATIC1111's and ComfyUI's ``checkpoints``), opened as a model.

The file holds the weights of a pipeline's models in their original (LDM) key layout, and nothing
else: configs, scheduler and tokenizers come from a diffusers folder of the same family
(memfit.models.single_file_configs). The family is found from the tensor names and shapes in the
header alone, by diffusers' own ``infer_diffusers_model_type``.

Streamed in place: a component's tensors are memory-mapped views of the file
(memfit.safetensors_header.MappedFile), converted to diffusers' names by diffusers' own converters.
A rename keeps the tensor, a 1x1 convolution read as a linear weight (``[:, :, 0, 0]``) or a row
slice of a fused tensor is a view, so the converted state dict holds views of the map, not copies,
and the component is built on the meta device and assigned those views. Where each live parameter
lives (key and view) is recorded on the module (``file_places``), so the disk tier streams it from
the file, the planner sizes it from the configs, and the weights check holds it to the file as a
folder's are. A tensor the converter had to compute (a transpose, a concatenation) is materialized
alone, recorded as such, and kept in memory.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memfit.errors import MemfitError
from memfit.models.folder import (PICKLE_SUFFIXES, ModelFolder, check_weight_entries, load_component,
                                  load_tensors_only, pickle_refused, size_mismatch)
from memfit.plan.meta import is_model_class
from memfit.safetensors_header import MappedFile, check_complete

__all__ = ["FAMILIES", "Family", "FilePlaces", "SingleFileModel", "TensorPlace", "detect_family", "file_places",
           "is_single_file", "record_places"]

PLACES_ATTR = "_memfit_file_places"


def _convert_unet(tensors: dict, prefix: str, config: dict, module) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    return convert_ldm_unet_checkpoint(tensors, config)


def _convert_vae(tensors: dict, prefix: str, config: dict, module) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return convert_ldm_vae_checkpoint(tensors, config)


def _convert_clip(tensors: dict, prefix: str, config: dict, module) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint

    converted = convert_ldm_clip_checkpoint(tensors, remove_prefix=prefix)
    if hasattr(module, "text_model"):
        return converted
    # transformers 5.6 flattened CLIPTextModel: its names no longer start with text_model.
    return {key.removeprefix("text_model."): value for key, value in converted.items()}


def _convert_open_clip(tensors: dict, prefix: str, config: dict, module) -> dict:
    """OpenCLIP's layout (SDXL's bigG encoder) in diffusers' names, by diffusers' own rename tables.

    As diffusers' convert_open_clip_checkpoint, except that q, k and v are row slices of the fused
    in_proj (views of the file, where diffusers copies them); the projection is stored transposed and
    so is the one tensor materialized.
    """
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    tables = DIFFUSERS_TO_LDM_MAPPING["openclip"]
    converted = {}
    for new, old in tables["layers"].items():
        if prefix + old in tensors:
            value = tensors[prefix + old]
            converted[new] = value.T.contiguous() if old == "text_projection" else value
    hidden = module.config.hidden_size
    stack = prefix + "transformer."
    for key, value in tensors.items():
        if not key.startswith(stack):
            continue
        name = key.removeprefix(stack)
        for new, old in tables["transformer"].items():
            name = name.replace(old, new)
        base, fused, kind = name.rpartition(".in_proj_")
        if not fused:
            converted[name] = value
            continue
        for index, projection in enumerate(("q_proj", "k_proj", "v_proj")):
            converted[f"{base}.{projection}.{kind}"] = value[index * hidden:(index + 1) * hidden]
    return converted


@dataclass(frozen=True)
class Part:
    """One model of a family's file: the prefix its tensors share, and the converter of them to diffusers'
    names, ``convert(tensors, prefix, config, empty module)`` (diffusers' own, or as diffusers does it)."""

    prefix: str
    convert: Callable[[dict, str, dict, torch.nn.Module], dict]


@dataclass(frozen=True)
class Family:
    """A family of all-in-one checkpoints memfit opens: ``model_type`` is diffusers' name for it
    (infer_diffusers_model_type), ``files`` the components whose files (scheduler, tokenizers) the
    config folder must hold beside the models' configs."""

    model_type: str
    label: str
    pipeline_class: str
    parts: dict[str, Part]
    files: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.label} ({', '.join(part.prefix + '*' for part in self.parts.values())})"


FAMILIES = {
    "v1": Family("v1", "Stable Diffusion 1.x", "StableDiffusionPipeline",
                 {"unet": Part("model.diffusion_model.", _convert_unet),
                  "vae": Part("first_stage_model.", _convert_vae),
                  "text_encoder": Part("cond_stage_model.transformer.", _convert_clip)},
                 ("scheduler", "tokenizer")),
    "xl_base": Family("xl_base", "Stable Diffusion XL", "StableDiffusionXLPipeline",
                      {"unet": Part("model.diffusion_model.", _convert_unet),
                       "vae": Part("first_stage_model.", _convert_vae),
                       "text_encoder": Part("conditioner.embedders.0.transformer.", _convert_clip),
                       "text_encoder_2": Part("conditioner.embedders.1.model.", _convert_open_clip)},
                      ("scheduler", "tokenizer", "tokenizer_2")),
}


def is_single_file(path: str | Path) -> bool:
    """Whether ``path`` names a checkpoint file (safetensors or pickle) rather than a model folder."""
    path = Path(path).expanduser()
    return path.suffix in (".safetensors", *PICKLE_SUFFIXES) and not path.is_dir()


def detect_family(path: Path, shapes: dict[str, tuple[torch.dtype, list[int]]]) -> Family:
    """The family of the checkpoint whose tensors are ``shapes`` (name -> (dtype, shape)), from names and
    shapes alone; one sentence naming what was found when memfit does not open it."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    # diffusers reads names and shapes; meta tensors give it both without a byte of data.
    probe = {key: torch.empty(shape, dtype=dtype, device="meta") for key, (dtype, shape) in shapes.items()}
    try:
        model_type = infer_diffusers_model_type(probe)
    except Exception:  # noqa: BLE001 - a branch that reads values, or a shape it did not expect: unknown to us
        model_type = None
    family = FAMILIES.get(model_type)
    supported = "; ".join(f.describe() for f in FAMILIES.values())
    if family is not None:
        missing = [part.prefix + "*" for part in family.parts.values()
                   if not any(key.startswith(part.prefix) for key in shapes)]
        if not missing:
            return family
        # diffusers calls whatever it does not recognise "v1": only the keys tell.
        if len(missing) < len(family.parts):
            raise MemfitError(
                f"{path} holds part of a {family.label} checkpoint but no {', '.join(missing)} tensors; memfit opens "
                f"all-in-one checkpoints, which hold every model of the pipeline (supported: {supported}).")
    elif model_type is not None:
        raise MemfitError(
            f"{path} is a checkpoint diffusers calls {model_type!r}, which memfit cannot open as a single file yet "
            f"(supported: {supported}); convert it to a diffusers folder with diffusers' from_single_file and "
            "save_pretrained, and pass that folder as --model.")
    counts: dict[str, int] = {}
    for key in shapes:
        top = key.split(".")[0] + "."
        counts[top] = counts.get(top, 0) + 1
    found = ", ".join(f"{top}* ({count})" for top, count in sorted(counts.items(), key=lambda item: -item[1])[:6])
    raise MemfitError(f"{path} holds {len(shapes)} tensors in a layout memfit does not recognise ({found or 'none'}); "
                      f"memfit opens all-in-one checkpoints of: {supported}.")


@dataclass(frozen=True)
class TensorPlace:
    """Where a live tensor lives in its file: the stored tensor ``key``, and the view of it (shape, stride,
    offset in elements) that the conversion made of it."""

    key: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class FilePlaces:
    """Where each live tensor of one component loaded from a single file lives in that file.

    ``places``: live name -> TensorPlace; ``materialized``: the names conversion had to compute, in no
    file. ``file`` is None for a pickle checkpoint, whose tensors memfit cannot map (``why`` says so).
    Shared, never copied, by copies of the module (the file behind it never changes while memfit runs).
    """

    def __init__(self, path: Path, file: MappedFile | None, places: dict[str, TensorPlace],
                 materialized: frozenset[str], why: str = ""):
        self.path = path
        self.file = file
        self.places = places
        self.materialized = materialized
        self.why = why

    def view(self, live_name: str) -> tuple[MappedFile, str, torch.Tensor] | None:
        """(file, stored key, the view of it that is ``live_name``), or None when the file does not hold it."""
        place = self.places.get(live_name)
        if place is None or self.file is None:
            return None
        stored = self.file.tensor(place.key)
        return self.file, place.key, stored.as_strided(place.shape, place.stride, place.offset)

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


def file_places(module: torch.nn.Module) -> FilePlaces | None:
    """The places ``module``'s weights were loaded from, when it was loaded from a single file."""
    return vars(module).get(PLACES_ATTR)


def record_places(module: torch.nn.Module, places: FilePlaces) -> None:
    object.__setattr__(module, PLACES_ATTR, places)


class _Checkpoint:
    """The tensors of one checkpoint file: names, dtypes and shapes from its header, and views of its
    memory map (safetensors), or the tensors torch's weights_only loader read (pickle)."""

    def __init__(self, path: Path, allow_pickle: bool):
        self.path = path
        self.file: MappedFile | None = None
        self._pickled: dict[str, torch.Tensor] = {}
        if path.suffix == ".safetensors":
            self.file = MappedFile(path, check_complete(path))
            self.shapes = {key: (self.file.dtype(key), list(entry["shape"])) for key, entry in self.file.entries.items()}
            return
        if path.suffix not in PICKLE_SUFFIXES:
            raise MemfitError(f"{path} is not a checkpoint memfit opens: give a .safetensors file (or a .ckpt with "
                              "--allow-pickle), or a diffusers model folder.")
        if not allow_pickle:
            raise MemfitError(pickle_refused(path, path.with_suffix(".safetensors")))
        state = load_tensors_only(path)
        state = state.get("state_dict", state) if isinstance(state, dict) else {}
        self._pickled = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
        self.shapes = {key: (value.dtype, list(value.shape)) for key, value in self._pickled.items()}

    def keys(self, prefix: str) -> list[str]:
        return [key for key in self.shapes if key.startswith(prefix)]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor under ``prefix``: views of the mapped file, no data read."""
        if self.file is None:
            return {key: self._pickled[key] for key in self.keys(prefix)}
        return {key: self.file.tensor(key) for key in self.keys(prefix)}

    def places(self, source: dict[str, torch.Tensor], converted: dict[str, torch.Tensor]) -> FilePlaces:
        """Where each tensor of ``converted`` (made from the views ``source``) lives in the file."""
        if self.file is None:
            return FilePlaces(self.path, None, {}, frozenset(converted),
                              why=f"{self.path} is a pickle checkpoint, which memfit cannot memory-map")
        by_storage = {tensor.untyped_storage().data_ptr(): key for key, tensor in source.items() if tensor.numel()}
        places, materialized = {}, set()
        for name, tensor in converted.items():
            key = by_storage.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
            if key is None:
                materialized.add(name)
            else:
                places[name] = TensorPlace(key, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        return FilePlaces(self.path, self.file, places, frozenset(materialized))


def _keep_in_fp32(cls, library: str, dtype: torch.dtype) -> list[str]:
    """The modules ``cls`` keeps in fp32 when loaded at ``dtype``, as diffusers and transformers do."""
    if dtype == torch.float32:
        return []
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    if library == "transformers":
        keep += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def _empty_model(library: str, class_name: str, config: dict, config_dir: Path) -> torch.nn.Module:
    """The component built from its config with its parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(library), class_name)
    with init_empty_weights():
        if library == "diffusers":
            return cls.from_config(config)
        return cls(cls.config_class.from_pretrained(config_dir))


@dataclass
class SingleFileModel(ModelFolder):
    """A model whose weights are one all-in-one checkpoint file (``path``) and whose configs, scheduler and
    tokenizers are a diffusers folder of its family (``config_dir``; ``config_source`` says how it was found).
    It runs wherever a ModelFolder does."""

    family: Family | None = None
    config_dir: Path | None = None
    config_source: str = ""
    # Every component the config folder's model_index.json names: those not loaded are passed as None.
    config_components: tuple[str, ...] = ()
    _checkpoint: _Checkpoint | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open_file(cls, path: str | Path, *, config: str | Path | None = None,
                  allow_pickle: bool = False) -> "SingleFileModel":
        """Open the checkpoint ``path``: its family from the header, its configs from ``config`` (a diffusers
        folder of that family) or where memfit.models.single_file_configs finds them."""
        from memfit.models.single_file_configs import find_configs

        path = Path(path).expanduser()
        if not path.exists():
            raise MemfitError(f"Checkpoint {path} does not exist; pass an all-in-one .safetensors file or a diffusers "
                              "model folder.")
        checkpoint = _Checkpoint(path, allow_pickle)
        family = detect_family(path, checkpoint.shapes)
        config_dir, source = find_configs(path, family, config)
        configs = ModelFolder.open(config_dir)
        if configs.class_name != family.pipeline_class:
            raise MemfitError(
                f"{config_dir} is a {configs.class_name} folder, but {path} is a {family.label} checkpoint "
                f"({family.pipeline_class}); give --config a diffusers folder of the same family.")
        # The models the file does not hold (a safety checker, an image encoder) are left out, as
        # diffusers' single-file loading leaves them.
        listed = tuple(configs.components)
        missing = [name for name in family.parts if name not in listed]
        if missing:
            raise MemfitError(f"{config_dir / 'model_index.json'} lists no {', '.join(missing)}, which a {family.label} "
                              "checkpoint holds; give --config the diffusers folder of a complete pipeline.")
        configs.components = {name: value for name, value in configs.components.items()
                              if name in family.parts or not is_model_class(*value)}
        configs.check_layout()
        configs.require_configs(family.parts)
        return cls(path, configs.class_name, configs.components, configs.configs, configs.defaults,
                   allow_pickle=allow_pickle, family=family, config_dir=config_dir, config_source=source,
                   config_components=listed, _checkpoint=checkpoint)

    def describe_source(self) -> str:
        return (f"model: {self.path.name}, a {self.family.label} single-file checkpoint ({self.class_name}); "
                f"configs and tokenizers from {self.config_source}")

    def component_fingerprint(self, name: str) -> str:
        """A model's by the tensors it reads from the file (and its config); a tokenizer's or scheduler's by
        its folder in the config folder."""
        if name not in self._fingerprints:
            from memfit.cache.fingerprint import fingerprint_folder, fingerprint_tensors

            part = self.family.parts.get(name)
            if part is None:
                self._fingerprints[name] = fingerprint_folder(self.config_dir / name)
            elif self._checkpoint.file is None:  # pickle: its tensors' bytes, read once
                from memfit.cache.fingerprint import combine_fingerprints

                tensors = self._checkpoint.tensors(part.prefix)
                self._fingerprints[name] = combine_fingerprints(
                    f"{key}:{tensor.dtype}:{list(tensor.shape)}:{_hash_tensor(tensor)}" for key, tensor in tensors.items())
            else:
                config = (self.config_dir / name / "config.json").read_bytes()
                self._fingerprints[name] = fingerprint_tensors(self.path, self._checkpoint.keys(part.prefix), config)
        return self._fingerprints[name]

    def check_layout(self) -> None:
        """Checked when opened: the file's family and its config folder."""

    def check_weights(self, names) -> None:
        """Checked when opened (a truncated file, a pickle without allow_pickle)."""

    def weight_files(self, name: str) -> list[Path]:
        return [self.path] if name in self.family.parts else []

    def file_dtype(self, name: str) -> torch.dtype | None:
        part = self.family.parts.get(name)
        if part is None or self._checkpoint.file is None:
            return None
        found = {self._checkpoint.shapes[key][0] for key in self._checkpoint.keys(part.prefix)}
        found = {dtype for dtype in found if dtype.is_floating_point}
        return found.pop() if len(found) == 1 else None

    def load_stage(self, names, dtype: torch.dtype, device: torch.device | None = None, *,
                   pipeline_class: str | None = None, external: dict[str, Path] | None = None,
                   in_file_dtype=()):
        """ModelFolder.load_stage for the file: each model converted from views of the file, the rest of the
        pipeline (scheduler, tokenizers) from the config folder."""
        import diffusers

        external = {name: folder for name, folder in (external or {}).items() if name in names}
        modules = {name: load_component(folder, dtype) for name, folder in external.items()}
        for name in names:
            if name in self.family.parts and name not in external:
                modules[name] = self._load_model(name, None if name in in_file_dtype else dtype)
        skipped = {name: None for name in self.config_components if name not in names or name not in self.components}
        try:
            pipe = getattr(diffusers, pipeline_class or self.class_name).from_pretrained(
                self.config_dir, **skipped, **modules)
        except MemfitError:
            raise
        except Exception as exc:  # diffusers and transformers raise many types; name the folder and the stage
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise MemfitError(f"Could not load {', '.join(names)} of {self.path} with the configs in {self.config_dir}: "
                              f"{type(exc).__name__}: {first_line}") from exc
        return self._ready(pipe, names, device)

    def _load_model(self, name: str, dtype: torch.dtype | None) -> torch.nn.Module:
        """Component ``name`` built from its config on the meta device and assigned the converted views of the
        file: in ``dtype`` (converted copies), or as stored when ``dtype`` is None."""
        library, class_name = self.components[name]
        part = self.family.parts[name]
        config = self.configs[name]
        module = _empty_model(library, class_name, config, self.config_dir / name)
        source = self._checkpoint.tensors(part.prefix)
        converted = part.convert(source, part.prefix, config, module)
        places = self._checkpoint.places(source, converted)
        entries = {key: (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), self.path)
                   for key, tensor in converted.items()}
        keep = _keep_in_fp32(type(module), library, dtype) if dtype is not None else []
        state = {}
        for key, tensor in converted.items():
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(torch.float32 if any(word in keep for word in key.split(".")) else dtype)
            state[key] = tensor
        try:
            module.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as exc:
            mismatch = size_mismatch(exc)
            if mismatch is None:
                raise MemfitError(f"Could not load {name} ({class_name}) from {self.path}: {exc}") from None
            key, stored, needed = mismatch
            place = places.places.get(key)
            stored_key = place.key if place is not None else key
            raise MemfitError(
                f"Tensor {stored_key!r} in {self.path} ({name}'s {key!r}) has shape {stored} where "
                f"{self.config_dir / name / 'config.json'} needs {needed}; the configs are for another model: give "
                f"--config a diffusers folder of this checkpoint's family and size.") from None
        # Missing, unexpected: as a folder's; a stray dtype is cast like every other tensor, as diffusers does.
        check_weight_entries(module, name, self.config_dir / name, entries, self.path, one_dtype=False)
        module.eval()
        record_places(module, places)
        return module


def _hash_tensor(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
