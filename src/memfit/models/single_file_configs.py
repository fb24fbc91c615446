"""Where a single-file checkpoint's configs, scheduler and tokenizers come from, offline first.

A checkpoint holds weights only. In this order:
  1. ``--config DIR``: a diffusers folder of the same family; only its model_index.json, component
     configs, scheduler and tokenizers are read, never its weights;
  2. the Hugging Face cache (HF_HOME): a snapshot of the family's default repository, the one
     diffusers' single-file loader names for it;
  3. only online (HF_HUB_OFFLINE not set): those small files of that repository, fetched once into the
     Hugging Face cache (``fetch_configs``), no weights;
  4. else one sentence naming the three ways.
The run's report says which one was used. diffusers never contacts the Hub on memfit's behalf: every
component is then loaded from this local folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["CONFIG_FILES", "default_repository", "fetch_configs", "find_configs"]

# The small files of a diffusers repository a single-file checkpoint needs: what fetch_configs downloads.
CONFIG_FILES = ["model_index.json", "*/config.json", "*/*_config.json", "tokenizer*/*.json", "tokenizer*/*.txt",
                "tokenizer*/*.model"]


def default_repository(family, *, paired: bool = False) -> str:
    """The repository diffusers' single-file loader takes a family's configs from (the family's own, where
    diffusers names none: Qwen-Image's); ``paired`` (a second expert read beside the file: Wan 2.2 A14B's), the
    family's pair_repository where it has one."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS

    if paired and family.pair_repository:
        return family.pair_repository
    return family.repository or DIFFUSERS_DEFAULT_PIPELINE_PATHS[family.model_type]["pretrained_model_name_or_path"]


def find_configs(checkpoint: Path, family, config: str | Path | None, flag: str = "--config", *,
                 paired: bool = False) -> tuple[Path, str]:
    """(the folder to read configs and tokenizers from, how it was found) for ``checkpoint`` of ``family``;
    ``config`` is what the user gave as ``flag``; ``paired``: a second expert is read beside it."""
    if config is not None:
        folder = Path(config).expanduser()
        if not folder.is_dir():
            raise MemfitError(f"{flag} {folder} is not a folder; give a diffusers model folder of the "
                              f"{family.label} family (only its configs and tokenizers are read).")
        return folder, f"{flag} {folder}"
    repository = default_repository(family, paired=paired)
    cached = _cached_snapshot(repository, family)
    if cached is not None:
        return cached, f"the Hugging Face cache's snapshot of {repository} ({cached})"
    reason = "HF_HUB_OFFLINE is set" if _offline() else ""
    if not reason:
        try:
            fetched = fetch_configs(repository)
        except Exception as exc:  # noqa: BLE001 - no network, a gated repository, ...: the sentence below says what to do
            reason = f"fetching them failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        else:
            if _complete(fetched, family):
                return fetched, f"{repository}, its configs and tokenizers fetched once into the Hugging Face cache"
            reason = f"{repository} lacks some of them"
    raise MemfitError(
        f"{checkpoint} is a {family.label} checkpoint, which holds weights but no configs or tokenizers, and none were "
        f"found ({reason or 'not in the Hugging Face cache'}): pass {flag} DIR, a diffusers folder of that family "
        f"(e.g. a download of {repository}; only its configs and tokenizers are read), or put {repository}'s configs "
        f"in the Hugging Face cache (huggingface-cli download {repository} --include "
        f"{' '.join(repr(p) for p in CONFIG_FILES)}), or run once online without HF_HUB_OFFLINE so memfit fetches "
        "those small files itself.")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1", "true", "yes", "on")


def _complete(folder: Path, family) -> bool:
    """Whether ``folder`` holds what a checkpoint of ``family`` needs: the index, the models' configs, and
    the scheduler's and tokenizers' folders."""
    return (folder / "model_index.json").is_file() and all((folder / name / "config.json").is_file()
                                                            for name in family.parts) \
        and all((folder / name).is_dir() and any((folder / name).iterdir()) for name in family.files)


def _hub_cache() -> str:
    """huggingface_hub's cache folder as the environment names it now (huggingface_hub reads it once, at import;
    a long-running server, or a test, may set it later)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def _cached_snapshot(repository: str, family) -> Path | None:
    """The Hugging Face cache's snapshot of ``repository`` when it holds what ``family`` needs; never the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repository, local_files_only=True, cache_dir=_hub_cache()))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return folder if _complete(folder, family) else None


def fetch_configs(repository: str) -> Path:
    """Download ``repository``'s configs and tokenizers (CONFIG_FILES, no weights) into the Hugging Face cache;
    its snapshot folder. Only called online: find_configs checks HF_HUB_OFFLINE first."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repository, allow_patterns=CONFIG_FILES, cache_dir=_hub_cache()))
