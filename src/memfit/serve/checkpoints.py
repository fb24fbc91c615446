"""The checkpoints memfit serve serves, named as AUTOMATIC1111 names them, and the one Session open at a time.

A1111's names for a checkpoint (its modules/sd_models.py): ``name`` is the path below the checkpoint
folder ("sd15/dreamshaper.safetensors"), ``model_name`` that with "/" as "_" and no extension, the
short hash the first 10 hex digits of the file's sha256, and the title "name [short hash]" (the
name alone while the hash is not known yet, as A1111 lists a checkpoint it has not hashed; a
diffusers folder has no one file to hash). A request may name a checkpoint by any name A1111
accepts for it (title, name, model_name, the file's stem, the short or full hash), never by a path:
only what is listed is served.

Hashes are read by a background thread, the selected checkpoint's first, and kept in memfit's store
(memfit.cache.file_hash): a listing never waits for one, and a file is read once per version.

One Session is open at a time. Switching releases the open Session's stages first, then opens the
new model (its stages are planned inside the budget when they run, with the memory in use then)
and keeps it warm. Each request runs on the checkpoint selected when it arrived (``selected``, A1111's
sd_model_checkpoint), or on the one its override_settings name, with the VAE file its sd_vae names read
instead of the checkpoint's own (``vae_file``; a different VAE is a switch too), and the module files its
forge_additional_modules name (Forge's setting: VAE and text encoder files of the models folder, each put in
the slot of the checkpoint it fits, ``modules_for``) read instead of the checkpoint's own or paired ones.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from memfit.cache.file_hash import file_sha256, stored_sha256
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.library import Listing, ModelEntry, ModelsDir, NamedFile, config_folders, open_entry
from memfit.run.session import Session
from memfit.safetensors_header import read_header

__all__ = ["Checkpoints", "OWN_VAE", "describe_lora", "short_name"]

OWN_VAE = ("Automatic", "None")  # A1111's sd_vae values that keep the checkpoint's own VAE


class Checkpoints:
    """The checkpoints of a server, the one selected, and the Session open on one of them (``session``, on
    ``current``). ``library``: the models folder they are listed from (None: ``session``'s model alone);
    ``pinned``: models listed first whatever a rescan finds (--model beside --models-dir);
    ``session_options``: the Session keyword arguments other than the model."""

    def __init__(self, session: Session, *, entry: ModelEntry | None = None, library: ModelsDir | None = None,
                 listing: Listing | None = None, pinned: tuple[ModelEntry, ...] = (),
                 session_options: dict[str, Any] | None = None):
        self.session = session
        self.current = self.selected = entry or replace(ModelEntry.for_path(session.folder.path),
                                                        pipeline=session.folder.class_name)
        self.current_vae: Path | None = None  # the VAE file the open Session reads instead of its model's own
        self.current_modules: tuple[tuple[str, Path], ...] = ()  # the (component, file) pairs it reads instead
        self.library = library
        self.pinned = pinned
        self.listing = listing or Listing([self.current], [], [])
        self._options = session_options or {}
        self._run_lock = threading.Lock()  # one run or switch at a time
        self._lock = threading.Lock()  # the hashes
        self._hashes: dict[Path, tuple[tuple[int, int], str]] = {}  # path -> (its size and mtime then, sha256)
        self._to_hash: queue.SimpleQueue = queue.SimpleQueue()
        # (checkpoint, module files) -> their slots: a request with a choice made is not checked against the files again
        self._slots: dict[tuple[Path, tuple[Path, ...]], tuple[tuple[str, Path], ...]] = {}
        threading.Thread(target=self._hash_files, name="memfit-serve-hashes", daemon=True).start()
        self._queue_hashes()

    @classmethod
    def open(cls, model: str | Path | None = None, *, models_dir: str | Path | None = None, configs=(),
             allow_pickle: bool = False, **session_options) -> "Checkpoints":
        """memfit serve's checkpoints: ``model`` alone (None: the built-in demo model), or every checkpoint in
        ``models_dir`` with ``model`` (a path, or a listed name) selected first, else the first listed.
        ``configs``: the --config folders, matched to a checkpoint file by its family."""
        configs = config_folders(configs)
        library = ModelsDir(models_dir, configs=configs, allow_pickle=allow_pickle) if models_dir else None
        listing = library.scan() if library else None
        entry, pinned = _first(model, library, listing)
        if library is None and configs and entry.kind == "diffusers":
            raise MemfitError(f"--config is for checkpoint files, but {entry.path} is a diffusers model folder, which "
                              "holds its own configs; leave --config out.")
        folder = open_entry(entry, configs=configs, allow_pickle=allow_pickle)  # what is wrong with --model stops here
        entry = replace(entry, pipeline=folder.class_name)
        session_options = {**session_options, "allow_pickle": allow_pickle}
        if listing is not None and pinned:
            listing = replace(listing, checkpoints=[entry, *listing.checkpoints])
        return cls(Session(folder, **session_options), entry=entry, library=library, pinned=(entry,) if pinned else (),
                   listing=listing, session_options=session_options)

    # ---- what is listed ------------------------------------------------------------------------
    def servable(self) -> list[ModelEntry]:
        return [entry for entry in self.listing.checkpoints if not entry.error]

    def sha256(self, entry: ModelEntry) -> str | None:
        with self._lock:
            return self._hashes.get(entry.path, (None, None))[1]

    def title(self, entry: ModelEntry) -> str:
        return _title(entry, self.sha256(entry))

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        """``entry`` as A1111's /sdapi/v1/sd-models gives a checkpoint (``config``: an LDM config file beside it)."""
        digest = self.sha256(entry)
        config = entry.path.with_suffix(".yaml") if entry.kind == "file" else None
        return {"title": self.title(entry), "model_name": _model_name(entry), "hash": digest[:10] if digest else None,
                "sha256": digest, "filename": str(entry.path),
                "config": str(config) if config is not None and config.is_file() else None}

    def find(self, requested: str) -> ModelEntry:
        """The listed checkpoint ``requested`` names (any name A1111 accepts for it); MemfitError naming the titles
        that can be served otherwise, or why the one named cannot be."""
        known = {entry.path: entry for entry in (*self.listing.checkpoints, self.selected, self.current)}
        for entry in known.values():
            if requested in _names(entry, self.sha256(entry)):
                if entry.error:
                    raise MemfitError(f"Checkpoint {self.title(entry)!r} cannot be served: {entry.error}")
                return entry
        titles = ", ".join(repr(self.title(entry)) for entry in self.servable())
        raise MemfitError(f"No checkpoint {requested!r} is listed; name one of {titles} (GET /sdapi/v1/sd-models "
                          "lists them; POST /sdapi/v1/refresh-checkpoints rescans the models folder).")

    def find_lora(self, requested: str) -> NamedFile:
        """The listed LoRA ``requested`` names (a prompt's <lora:NAME:...>): by its name (the file's stem), else by
        its alias (the name it was trained under), as A1111 finds one; MemfitError naming the listed ones otherwise."""
        loras = self.listing.loras
        found = next((lora for lora in loras if lora.name == requested), None)
        found = found or next((lora for lora in loras if describe_lora(lora)["alias"] == requested), None)
        if found is None and not loras:
            raise MemfitError(f"No LoRA {requested!r} is listed: this server lists none; start memfit serve with "
                              "--models-dir DIR, whose Lora/ or loras/ folder holds the LoRA files.")
        if found is None:
            listed = ", ".join(repr(lora.name) for lora in loras)
            raise MemfitError(f"No LoRA {requested!r} is listed; name one of {listed} (GET /sdapi/v1/loras lists them; "
                              "POST /sdapi/v1/refresh-loras rescans the models folder).")
        return found

    def vae_file(self, name: str) -> Path | None:
        """The VAE file A1111's sd_vae ``name`` selects: None for the checkpoint's own ("Automatic", "None": a
        NAME.vae.safetensors beside the checkpoint is not looked for); MemfitError for one not listed."""
        if name in OWN_VAE:
            return None
        found = next((vae.path for vae in self.listing.vaes if vae.name == name), None)
        if found is None:
            listed = ", ".join(repr(vae.name) for vae in self.listing.vaes) or "none (start memfit serve with " \
                "--models-dir DIR, whose VAE/ or vae/ folder holds the VAE files)"
            raise MemfitError(f"{name!r} is not a VAE this server lists; send \"Automatic\" or \"None\" (the "
                              f"checkpoint's own VAE) or one of the VAE files listed: {listed}.")
        return found

    def module_file(self, requested: str) -> Path:
        """The module file (VAE or text encoder, GET /sdapi/v1/sd-modules) ``requested`` names by its model_name or
        filename; MemfitError naming those listed otherwise."""
        modules = self.listing.modules()
        found = next((module.path for module in modules if requested in (module.name, str(module.path))), None)
        if found is None:
            listed = ", ".join(repr(module.name) for module in modules) or "none (start memfit serve with " \
                "--models-dir DIR, whose vae/ and text_encoders/ folders hold the module files)"
            raise MemfitError(f"{requested!r} is not a module file this server lists; name one of {listed} (GET "
                              "/sdapi/v1/sd-modules lists them; POST /sdapi/v1/refresh-vae rescans the models folder).")
        return found

    def modules_for(self, entry: ModelEntry, files: list[Path] | tuple[Path, ...]) -> tuple[tuple[str, Path], ...]:
        """The (component, file) pairs that put each of ``files`` in the slot of ``entry``'s model it fits (its VAE or
        a text encoder; a slot a file was listed as a candidate for tried first); MemfitError naming a file that fits
        none of the slots left, and those slots."""
        if not files:
            return ()
        key = (entry.path, tuple(files))
        if key not in self._slots:
            self._slots[key] = self._fit_modules(entry, files)
        return self._slots[key]

    def _fit_modules(self, entry: ModelEntry, files) -> tuple[tuple[str, Path], ...]:
        """modules_for, checked against the files: each tried in the free slots as --component NAME=FILE is."""
        from memfit.models.single_file import SingleFileModel

        folder = self.folder(entry)
        slots = [name for name in folder.model_components if name == "vae" or name.startswith("text_encoder")]
        listed = {name: paths for name, paths in entry.candidates}
        chosen: dict[str, Path] = {}
        for file in files:
            free = sorted((slot for slot in slots if slot not in chosen), key=lambda slot: file not in listed.get(slot, ()))
            for slot in free:
                try:
                    SingleFileModel.with_components(folder, {slot: file}, allow_pickle=folder.allow_pickle)
                except MemfitError:
                    continue  # another model's file, or another family's
                chosen[slot] = file
                break
            else:
                taken = "; ".join(f"{slot} is taken by {chosen[slot].name}" for slot in chosen)
                raise MemfitError(f"Module {file.name} ({file}) fits none of the slots of {self.title(entry)!r} "
                                  f"({', '.join(free) or 'none left'}){'; ' + taken if taken else ''}; choose files "
                                  "that fit its VAE or text encoders (GET /memfit/v1/models lists each checkpoint's "
                                  "candidates).")
        return tuple(chosen.items())

    def refresh(self) -> None:
        """List the models folder again (a new file, a finished copy); the open Session is kept."""
        if self.library is not None:
            listing = self.library.scan()
            self._slots = {}  # a file may have changed
            with self._lock:  # a file changed since it was hashed is listed without a hash until hashed again
                self._hashes = {path: known for path, known in self._hashes.items() if _version(path) == known[0]}
            self.listing = replace(listing, checkpoints=[*self.pinned, *listing.checkpoints])
            self._queue_hashes()

    # ---- running -------------------------------------------------------------------------------
    def folder(self, entry: ModelEntry, vae: Path | None = None,
               modules: tuple[tuple[str, Path], ...] = ()) -> ModelFolder:
        """``entry``'s model with ``vae`` (a VAE file) for its own and ``modules`` ((component, file) pairs, from
        modules_for) for those components, opened: the open Session's, or opened now (its header and configs: what
        a request is checked against). Nothing opened is kept beside the open Session, whose budget would not
        count it."""
        if (entry.path, vae, modules) == (self.current.path, self.current_vae, self.current_modules):
            return self.session.folder
        library = self.library
        return open_entry(entry, configs=library.configs if library else None,
                          allow_pickle=self._options.get("allow_pickle", False), vae=vae, modules=modules)

    def select(self, entry: ModelEntry, vae: Path | None = None, modules: tuple[tuple[str, Path], ...] = ()) -> None:
        """Make ``entry`` the checkpoint requests run on (A1111's sd_model_checkpoint), switching to it (with the
        VAE file ``vae``, None: its own, and the module files ``modules``) now."""
        with self._run_lock:
            self._switch(entry, vae, modules)
            self.selected = entry

    def generate(self, prompt: str, *, checkpoint: ModelEntry | None = None, vae: Path | None = None,
                 modules: tuple[tuple[str, Path], ...] = (), **settings):
        """Session.generate on ``checkpoint`` (default: the selected one) with the VAE file ``vae`` (None: its
        own) and the module files ``modules``, switching to them first if needed."""
        with self._run_lock:
            return self._switch(checkpoint or self.selected, vae, modules).generate(prompt, **settings)

    def close(self) -> None:
        self._to_hash.put(None)
        self.session.close()

    def _switch(self, entry: ModelEntry, vae: Path | None = None,
                modules: tuple[tuple[str, Path], ...] = ()) -> Session:
        if (entry.path, vae, modules) != (self.current.path, self.current_vae, self.current_modules):
            folder = self.folder(entry, vae, modules)
            self.session.close()  # the old stages go before the new model's are planned
            self.session = Session(folder, **self._options)
            self.current, self.current_vae, self.current_modules = entry, vae, modules
        return self.session

    # ---- hashes --------------------------------------------------------------------------------
    def _queue_hashes(self) -> None:
        files = [entry.path for entry in (self.selected, *self.servable()) if entry.kind != "diffusers"]
        for path in dict.fromkeys(files):
            self._to_hash.put(path)

    def _hash_files(self) -> None:
        while (path := self._to_hash.get()) is not None:
            try:
                version = _version(path)
                digest = stored_sha256(path) or file_sha256(path)
            except OSError:  # gone or unreadable since it was listed: listed without a hash
                continue
            with self._lock:
                self._hashes[path] = (version, digest)


def _version(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


# A1111 lists a LoRA's training metadata in this order, the rest after them.
LORA_METADATA_ORDER = {"ss_sd_model_name": 1, "ss_resolution": 2, "ss_clip_skip": 3, "ss_num_train_images": 10,
                       "ss_tag_frequency": 20}


def describe_lora(lora: NamedFile) -> dict[str, Any]:
    """``lora`` as A1111's /sdapi/v1/loras gives it: its name, alias (the name it was trained under), path, and the
    training metadata of a .safetensors file (values that are JSON objects decoded, cover images left out)."""
    metadata: dict[str, Any] = {}
    if lora.path.suffix == ".safetensors":
        try:
            stored = read_header(lora.path).metadata
        except MemfitError:  # a damaged file is still listed, as A1111 lists it, without metadata
            stored = {}
        for key, value in stored.items():
            if isinstance(value, str) and value.startswith("{"):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    pass
            metadata[key] = value
        metadata.pop("ssmd_cover_images", None)
        metadata = dict(sorted(metadata.items(), key=lambda item: LORA_METADATA_ORDER.get(item[0], 999)))
    return {"name": lora.name, "alias": metadata.get("ss_output_name", lora.name), "path": str(lora.path),
            "metadata": metadata}


def short_name(entry: ModelEntry) -> str:
    """A1111's name_for_extra: the file's stem, or the folder's name (what an image's info names as its model)."""
    return entry.path.name if entry.kind == "diffusers" else entry.path.stem


def _title(entry: ModelEntry, digest: str | None) -> str:
    return f"{entry.name} [{digest[:10]}]" if digest else entry.name


def _names(entry: ModelEntry, digest: str | None) -> set[str]:
    """Every name A1111 accepts for a checkpoint (its ids), with ``digest`` its sha256 when known."""
    names = {_title(entry, digest), entry.name, _model_name(entry), short_name(entry)}
    if digest:
        names |= {digest, digest[:10], f"{short_name(entry)} [{digest[:10]}]"}
    return names


def _model_name(entry: ModelEntry) -> str:
    name = entry.name.replace("/", "_").replace("\\", "_")
    return name if entry.kind == "diffusers" else Path(name).stem


def _first(model, library: ModelsDir | None, listing: Listing | None) -> tuple[ModelEntry, bool]:
    """The checkpoint served first, and whether it is listed apart from the models folder (pinned)."""
    if library is None:
        if model is None:
            from memfit.demo import model_dir

            model = model_dir()
        return ModelEntry.for_path(model), False
    if model is None:
        entry = next((entry for entry in listing.checkpoints if not entry.error), None)
        if entry is None:
            found = "; ".join(f"{entry.name}: {entry.error}" for entry in listing.checkpoints) or "none"
            raise MemfitError(f"No checkpoint in {library.root} can be served (found: {found}); put an all-in-one "
                              ".safetensors checkpoint or a diffusers model folder there, or pass --model.")
        return entry, False
    path = Path(model).expanduser()
    if path.exists():
        listed = next((entry for entry in listing.checkpoints if entry.path.resolve() == path.resolve()), None)
        return (listed, False) if listed is not None else (ModelEntry.for_path(path), True)
    named = [entry for entry in listing.checkpoints if model in _names(entry, stored_sha256(entry.path)
                                                                       if entry.kind != "diffusers" else None)]
    if not named:
        raise MemfitError(f"--model {model} is neither a model path nor a checkpoint listed in {library.root} "
                          f"({', '.join(entry.name for entry in listing.checkpoints) or 'none'}).")
    return named[0], False
