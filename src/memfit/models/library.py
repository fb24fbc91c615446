"""The models a folder holds, kept the way AUTOMATIC1111 and ComfyUI keep them: what ``memfit serve
--models-dir`` lists and switches between.

Layouts, by the names of the folder's subfolders (in any case):

    A1111 / Forge   Stable-diffusion/ (all-in-one checkpoints), VAE/, Lora/ (and LyCORIS/)
    ComfyUI         checkpoints/ (all-in-one), diffusion_models/ or unet/ (a denoiser alone), text_encoders/
                    or clip/, vae/, loras/
    otherwise       the folder itself holds the checkpoints: diffusers model folders and all-in-one files

A webui's root folder, whose models/ holds those, is taken too. A checkpoint folder is searched in
depth (A1111's names keep the subfolder: "sd15/dreamshaper.safetensors"); a folder holding
model_index.json is one diffusers model.

Every checkpoint is opened when listed, as ``memfit generate --model`` opens it (a file's header,
family and configs; a diffusers folder's layout and weight files), so one memfit cannot serve (a
half-copied file, an unknown layout, a pickle without --allow-pickle) is listed with the reason
instead of dropped, and never found out at the first request. A denoiser alone (ComfyUI's split
layout: a Flux transformer in diffusion_models/ beside its VAE in vae/ and its text encoders in
text_encoders/; a Wan, Qwen-Image, Chroma or Z-Image transformer with its VAE and text encoder) is
paired with them by family: for each model its family needs that neither the file nor its config folder
holds, the first file of the folder that fits it (the same check as ``--component NAME=FILE``; files whose
name says the family's, such as wan_2.1_vae, tried first); one nothing fits is listed with the reason.
Every file that fits is kept as a candidate (``ModelEntry.candidates``, the first the default): memfit serve
lets a client choose another (Forge's forge_additional_modules). Wan 2.2 A14B's two experts, kept as two files
named for the high-noise and low-noise steps (``expert_pairs``), are one checkpoint: the high-noise file, with the
other as its transformer_2.

The --config folders (``config_folders``) are matched to a file by its family's pipeline class, and of several of one
class by its models (``_config_for``: Wan 2.1's and Wan 2.2's are both WanPipeline folders).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.locate import PICKLE_SUFFIXES
from memfit.models.model_path import open_model_path


__all__ = ["Listing", "ModelEntry", "ModelsDir", "NamedFile", "config_folders", "expert_pairs", "open_entry"]

# What each subfolder holds, by its name in lower case ("parts": text encoders of split models, not listed).
ROLES = {"stable-diffusion": "checkpoints", "checkpoints": "checkpoints", "diffusion_models": "split", "unet": "split",
         "text_encoders": "parts", "clip": "parts", "vae": "vae", "lora": "lora", "loras": "lora", "lycoris": "lora"}
MAPPED_SUFFIXES = (".safetensors", ".gguf")  # the files memfit reads by their header and maps
WEIGHT_SUFFIXES = (*MAPPED_SUFFIXES, *PICKLE_SUFFIXES)
# Formats users keep beside the others that memfit cannot read yet: listed with that reason.
UNREAD_SUFFIXES = (".sft",)


@dataclass(frozen=True)
class ModelEntry:
    """One checkpoint: ``name`` is its path below its folder, "/"-separated (A1111's checkpoint name); ``kind``
    "file" (all-in-one), "diffusers" (a model folder) or "split" (a denoiser alone); ``error`` says why memfit
    cannot serve it ("" when it can), ``pipeline`` the diffusers class it runs as when it can."""

    name: str
    path: Path
    kind: str
    error: str = ""
    pipeline: str = ""
    # A denoiser alone: the files of the models paired with it ((component, file) pairs, as --component gives them).
    components: tuple[tuple[str, Path], ...] = ()
    # ... and every file of the folder that fits each of those models, the one paired first: what a client may choose.
    candidates: tuple[tuple[str, tuple[Path, ...]], ...] = ()

    @classmethod
    def for_path(cls, path: str | Path) -> "ModelEntry":
        """The entry of a model named by its path (--model), listed by its file or folder name."""
        path = Path(path).expanduser()
        return cls(path.name or str(path), path, "diffusers" if path.is_dir() else "file")


@dataclass(frozen=True)
class NamedFile:
    """A VAE or LoRA file and the name A1111 lists it by."""

    name: str
    path: Path


@dataclass(frozen=True)
class Listing:
    checkpoints: list[ModelEntry]
    vaes: list[NamedFile]
    loras: list[NamedFile]
    # The text encoder files of text_encoders/ or clip/ (Forge lists them with the VAEs as "modules").
    text_encoders: list[NamedFile] = field(default_factory=list)

    def modules(self) -> list[NamedFile]:
        """The files that may replace a checkpoint's VAE or text encoders, as Forge's /sdapi/v1/sd-modules lists them."""
        return [*self.vaes, *self.text_encoders]


def _natural_key(text: str) -> list:
    """A1111's order: digits by value, letters without case ("v2" before "v10")."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", text)]


def _config_for(path: Path, configs: dict[Path, str], components: dict[str, Path] | None = None) -> Path | None:
    """The --config folder for the checkpoint file ``path`` (read with ``components``, name -> file, beside it): one of
    its family's pipeline class (``configs``: folder -> pipeline class), None where there is none (memfit then looks in
    the Hugging Face cache); for a pickle, the first. Of several folders of that class (Wan 2.1's and Wan 2.2's are
    both WanPipeline folders), the first whose models are the files' (_fit), else the first whose models fit the
    file's own, else the first: opening the file with it then says what does not fit."""
    if not configs or path.suffix not in MAPPED_SUFFIXES:  # a pickle is read only to open it: the first folder serves
        return next(iter(configs), None)
    from memfit.models.single_file import detect_family, file_shapes

    try:
        family = detect_family(path, file_shapes(path))
    except MemfitError:  # opening it names what is wrong
        return None
    same = [folder for folder, class_name in configs.items() if class_name == family.pipeline_class]
    if len(same) < 2:
        return next(iter(same), None)
    fits = [_fit(path, folder, components or {}) for folder in same]
    return same[fits.index(max(fits))]


def _fit(path: Path, config: Path, components: dict[str, Path]) -> int:
    """How well ``config``'s models are the ones the file ``path`` and the ``components`` files hold: 2 when each read
    there has the config's shapes (checked from the headers, no data read) and the config has a denoiser exactly
    where they give one (Wan 2.2 A14B's second expert, transformer_2, is a file of its own); 1 when the file's own
    models fit it; else 0."""
    from memfit.models.families import DENOISER_NAMES
    from memfit.models.single_file import SingleFileModel

    try:
        model = SingleFileModel.open_file(path, config=config)
        model.check_fits()
    except MemfitError:
        return 0
    try:
        model = SingleFileModel.with_components(model, components)
    except MemfitError:
        return 1
    given = {name for name in (*model.weights, *components) if name in DENOISER_NAMES}
    return 2 if given == {name for name in model.model_components if name in DENOISER_NAMES} else 1


def open_entry(entry: ModelEntry, *, configs: dict[Path, str] | None = None, allow_pickle: bool = False,
               vae: Path | None = None, modules: tuple[tuple[str, Path], ...] = ()) -> ModelFolder:
    """The model ``entry`` names, opened and its weight files checked as memfit serve checks its --model;
    MemfitError saying what is wrong otherwise. ``configs``: --config folder -> pipeline class; ``modules``:
    (component, file) pairs read instead of the model's own or paired ones (Forge's forge_additional_modules);
    ``vae``: a VAE file read instead of the model's own VAE (A1111's sd_vae, over a VAE among ``modules``)."""
    from memfit.plan.stages import planned_models

    if entry.path.suffix in UNREAD_SUFFIXES:
        raise MemfitError(f"{entry.path} is a {entry.path.suffix} file, which memfit cannot read yet; memfit opens "
                          ".safetensors and .gguf checkpoints (and pickle ones with --allow-pickle) and diffusers "
                          "folders.")
    configs = configs or {}
    components = {**dict(entry.components), **dict(modules), **({"vae": vae} if vae is not None else {})}
    config = _config_for(entry.path, configs, components) if entry.kind != "diffusers" else None
    try:
        folder = open_model_path(entry.path, config=config, allow_pickle=allow_pickle, components=components or None)
    except MemfitError as exc:
        if entry.kind == "diffusers" or config is not None or not configs:
            raise
        raise MemfitError(f"{exc} (The --config folders given are for {', '.join(dict.fromkeys(configs.values()))}, "
                          "not its family.)") from None
    folder.check_layout()
    folder.allow_pickle = allow_pickle
    folder.check_weights(planned_models(folder.adapter))
    return folder


def _probe(entry: ModelEntry, configs: dict[Path, str], allow_pickle: bool) -> ModelEntry:
    """``entry`` with the pipeline it runs as, or the reason it cannot be served."""
    try:
        folder = open_entry(entry, configs=configs, allow_pickle=allow_pickle)
    except MemfitError as exc:
        return replace(entry, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a file diffusers or torch cannot read: listed with why, not fatal
        return replace(entry, error=f"{entry.path} cannot be read: {type(exc).__name__}: {exc}")
    return replace(entry, pipeline=folder.class_name)


class ModelsDir:
    """A models folder (``root``) and how its checkpoints open: ``configs`` (config_folders: the --config folders and
    their pipeline classes, matched to a file by its family and its models) and ``allow_pickle``. ``scan()`` lists it
    as it is now."""

    def __init__(self, root: str | Path, *, configs: dict[Path, str] | None = None, allow_pickle: bool = False):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise MemfitError(f"--models-dir {self.root} is not a folder; give the folder that holds Stable-diffusion/ "
                              "(A1111), checkpoints/ (ComfyUI) or diffusers model folders.")
        if (self.root / "model_index.json").is_file():
            raise MemfitError(f"--models-dir {self.root} is one diffusers model folder; serve it with --model "
                              f"{self.root}, or give --models-dir the folder that holds it.")
        self.configs = configs or {}
        self.allow_pickle = allow_pickle

    def scan(self) -> Listing:
        """Every checkpoint, VAE and LoRA under the folder, each checkpoint opened to say whether it can be served."""
        base = self.root if _roles(self.root) or not _roles(self.root / "models") else self.root / "models"
        roles = _roles(base)
        checkpoint_roots = [path for path, role in roles.items() if role == "checkpoints"] or ([] if roles else [base])
        found: list[ModelEntry] = []
        vaes: list[NamedFile] = []
        for root in checkpoint_roots:
            for path in _walk(root, models=True):
                name = path.relative_to(root).as_posix()
                if path.is_file() and _is_vae_file(path):  # A1111 keeps a checkpoint's VAE beside it: x.vae.pt
                    vaes.append(NamedFile(path.name, path))
                else:
                    found.append(ModelEntry(name, path, "diffusers" if path.is_dir() else "file"))
        vaes += [NamedFile(path.name, path) for root, role in roles.items() if role == "vae" for path in _walk(root)]
        parts = [path for root, role in roles.items() if role == "parts" for path in _walk(root)]
        for root in (path for path, role in roles.items() if role == "split"):
            denoisers = list(_walk(root))
            experts = expert_pairs(denoisers)
            second = set(experts.values())
            found += [self._paired(ModelEntry(path.relative_to(base).as_posix(), path, "split",
                                              components=(("transformer_2", experts[path]),) if path in experts else ()),
                                   [vae.path for vae in vaes], parts) for path in denoisers if path not in second]
        text_encoders = [NamedFile(path.name, path) for path in parts]
        loras = {}
        for root in (path for path, role in roles.items() if role == "lora"):
            for path in _walk(root):
                if path.suffix in WEIGHT_SUFFIXES:
                    loras.setdefault(path.stem, NamedFile(path.stem, path))
        checkpoints = [entry if entry.error else _probe(entry, self.configs, self.allow_pickle) for entry in found]
        return Listing(checkpoints, sorted(vaes, key=lambda f: _natural_key(f.name)), list(loras.values()),
                       text_encoders)


    def _paired(self, entry: ModelEntry, vaes: list[Path], parts: list[Path]) -> ModelEntry:
        """The denoiser alone ``entry`` with, for each model its family needs that neither its file nor its
        config folder holds, the first of ``vaes`` (for the VAE) or ``parts`` (text encoders) that fits it, and every
        one that fits as its candidates."""
        from memfit.models.single_file import SingleFileModel

        if entry.path.suffix not in MAPPED_SUFFIXES:
            return entry  # opening it says why it cannot be served
        given = dict(entry.components)  # Wan 2.2 A14B's second expert
        try:
            model = SingleFileModel.open_file(entry.path, config=_config_for(entry.path, self.configs, given),
                                              allow_pickle=self.allow_pickle, paired="transformer_2" in given)
            if given:
                model = SingleFileModel.with_components(model, given, allow_pickle=self.allow_pickle)
        except MemfitError as exc:
            return replace(entry, error=str(exc))
        fitting: dict[str, tuple[Path, ...]] = {}
        unpaired = []
        family = model.family
        for name in (family.parts if family is not None else ()):
            if name in model.weights or model.weight_files(name):
                continue
            part = family.parts[name]
            # A file whose name says it is this part's first: two files may fit (Wan 2.1's VAE and Qwen-Image's).
            candidates = sorted(vaes if name == "vae" else parts, key=lambda path: not part.named_for(path))
            fits = []
            for candidate in candidates:
                try:
                    SingleFileModel.with_components(model, {name: candidate}, allow_pickle=self.allow_pickle)
                except MemfitError:
                    continue  # another family's, or another of this family's models
                fits.append(candidate)
            if fits:
                fitting[name] = tuple(fits)
            else:
                usual = part.usual_file
                unpaired.append(f"{name} ({model.components[name][1]}{', e.g. ' + usual if usual else ''}) in "
                                f"{'vae/' if name == 'vae' else 'text_encoders/ or clip/'}")
        if unpaired:
            return replace(entry, error=f"{entry.path} is a {family.label} denoiser alone, and no file of the models "
                                        f"folder fits its {'; '.join(unpaired)}: put that file there and refresh.")
        return replace(entry, components=(*entry.components, *((name, fits[0]) for name, fits in fitting.items())),
                       candidates=tuple(fitting.items()))


# Wan 2.2 A14B's two experts as ComfyUI and QuantStack name their files: wan2.2_t2v_high_noise_14B_fp16.safetensors
# and wan2.2_t2v_low_noise_14B_fp16.safetensors, Wan2.2-I2V-A14B-HighNoise-Q4_K_M.gguf and ...-LowNoise-....
_EXPERT_WORD = re.compile(r"(high|low)(?=[_\-. ]?noise)", re.IGNORECASE)


def expert_pairs(paths) -> dict[Path, Path]:
    """The high-noise expert file -> the low-noise one of the same name in the same folder, among ``paths``: Wan 2.2
    A14B's transformer (run for the high-noise steps) and transformer_2."""
    found: dict[tuple[Path, str], dict[str, Path]] = {}
    for path in paths:
        match = _EXPERT_WORD.search(path.name)
        if match is not None:
            stem = (path.name[:match.start()] + "*" + path.name[match.end():]).lower()
            found.setdefault((path.parent, stem), {})[match.group(1).lower()] = path
    return {pair["high"]: pair["low"] for pair in found.values() if len(pair) == 2}


def config_folders(configs) -> dict[Path, str]:
    """The --config folders, in the order given, with the pipeline class each holds configs for (a file takes one of
    its family's class, the first whose models fit it when there are several: _config_for)."""
    folders: dict[Path, str] = {}
    for config in configs:
        folder = ModelFolder.open(config)
        if folder.path in folders:
            raise MemfitError(f"--config {config} is given twice; give each config folder once.")
        folders[folder.path] = folder.class_name
    return folders


def _roles(folder: Path) -> dict[Path, str]:
    if not folder.is_dir():
        return {}
    return {path: ROLES[path.name.lower()] for path in sorted(folder.iterdir())
            if path.is_dir() and path.name.lower() in ROLES}


def _is_vae_file(path: Path) -> bool:
    return path.stem.lower().endswith(".vae")


def _walk(root: Path, *, models: bool = False, seen: set | None = None):
    """The weight files under ``root`` in A1111's order, a folder's files before its subfolders (and, with
    ``models``, the diffusers folders, not entered); hidden names left out, a folder reached twice through
    links read once."""
    seen = set() if seen is None else seen
    if root.resolve() in seen:
        return
    seen.add(root.resolve())
    try:
        children = sorted((path for path in root.iterdir() if not path.name.startswith(".")),
                          key=lambda path: _natural_key(path.name))
    except OSError:  # unreadable: nothing listed from it
        return
    yield from (path for path in children if path.is_file() and path.name.lower().endswith(
        WEIGHT_SUFFIXES + UNREAD_SUFFIXES))
    for path in children:
        if path.is_dir() and models and (path / "model_index.json").is_file():
            yield path
        elif path.is_dir():
            yield from _walk(path, models=models, seen=seen)
