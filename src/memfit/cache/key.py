"""Content-addressed cache keys.

A key is a *kind* (the namespace an entry lives in: "compiled", "embeddings", ...) plus a dict of
content parts, hashed canonically: sorted-key JSON, then sha256. Two keys with the same content give
the same digest in every process and on every machine, whatever the dict's insertion order.

Parts describe *content*, never names: a weights fingerprint, a config, an input signature, a
backend name and its options, library versions. A pipeline's part names ("unet", "vae") must not
be part of a key, so a component shared by two pipelines (SDXL base and refiner share one VAE) maps
to one entry, stored once and loadable into both.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Mapping

from memfit.errors import MemfitError

# Bump when the on-disk layout or the meaning of a key changes: every older entry then misses
# (it is never misread) and ages out through LRU eviction.
CACHE_FORMAT_VERSION = 2

# Kinds become directory names, so keep them to a safe, portable alphabet.
_KIND_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def _to_json_value(value: Any) -> Any:
    """Turn the few non-JSON types that naturally appear in keys into stable JSON values.

    Anything else is refused rather than str()-ed: a repr can embed a memory address and would
    make the key differ between runs (a cache that never hits) without any error.
    """
    if isinstance(value, enum.Enum):
        return _to_json_value(value.value)
    if isinstance(value, PurePath):
        return value.as_posix()
    if isinstance(value, (set, frozenset)):
        return sorted(_to_json_value(v) for v in value)
    if isinstance(value, bytes):
        return value.hex()
    type_name = f"{type(value).__module__}.{type(value).__qualname__}"
    # torch types are checked by name so that building a key never imports torch.
    if type_name in ("torch.dtype", "torch.device"):
        return str(value)
    if type_name == "torch.Size":
        return list(value)
    raise TypeError(type_name)


def canonical_json(parts: Mapping[str, Any]) -> str:
    """Serialize key parts the same way everywhere: sorted keys, no whitespace, no NaN."""

    def check_floats(value: Any, where: str) -> None:
        # JSON has no NaN/inf, and NaN != NaN would make two "equal" keys differ.
        if isinstance(value, float) and not math.isfinite(value):
            raise MemfitError(
                f"Cache key part {where!r} is {value!r}; keys must be finite numbers. "
                "Pass a string instead if the value is meaningful."
            )
        if isinstance(value, Mapping):
            for k, v in value.items():
                check_floats(v, f"{where}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check_floats(v, f"{where}[{i}]")

    for name, value in parts.items():
        if not isinstance(name, str):
            raise MemfitError(f"Cache key part names must be strings; got {name!r}.")
        check_floats(value, name)
    try:
        return json.dumps(
            parts,
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
            default=_to_json_value,
        )
    except TypeError as exc:
        raise MemfitError(
            f"Cache key parts must be JSON values (str, int, float, bool, None, list, dict, "
            f"torch.dtype/device/Size, Path, Enum); got a {exc} in {sorted(parts)}. "
            "Convert it to a stable string or number before building the key."
        ) from None


@dataclass(frozen=True)
class CacheKey:
    """The identity of one cache entry: ``CacheKey("compiled", {"weights": fp, ...})``."""

    kind: str
    parts: Mapping[str, Any]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not _KIND_PATTERN.match(self.kind):
            raise MemfitError(
                f"Cache kind {self.kind!r} is not valid: use 1-64 lowercase letters, digits, "
                "'_', '-' or '.', starting with a letter or digit (it becomes a directory name)."
            )
        # Hash the kind and the format version too: a prompt embedding and a compiled graph with
        # equal parts must never collide, and a format bump must miss every old entry.
        material = canonical_json(
            {"format": CACHE_FORMAT_VERSION, "kind": self.kind, "parts": dict(self.parts)}
        )
        object.__setattr__(self, "digest", hashlib.sha256(material.encode("utf-8")).hexdigest())
        # Freeze a JSON round-trip of the parts so later mutation of the caller's dict cannot
        # make the stored manifest disagree with the digest.
        object.__setattr__(self, "parts", json.loads(canonical_json(dict(self.parts))))

    @property
    def short(self) -> str:
        return f"{self.kind}/{self.digest[:12]}"

    def summary(self, width: int = 72) -> str:
        """A one-line, human-readable description of the parts (for `memfit cache ls`)."""
        return summarize_parts(self.parts, width)

    def __str__(self) -> str:
        return f"{self.short} ({self.summary()})"


def summarize_parts(parts: Mapping[str, Any], width: int = 72) -> str:
    items = []
    for name in sorted(parts):
        value = parts[name]
        if isinstance(value, (dict, list)):
            text = canonical_json({"v": value})[5:-1]
        else:
            text = str(value)
        if len(text) > 16:
            text = text[:13] + "..."
        items.append(f"{name}={text}")
    line = " ".join(items)
    return line if len(line) <= width else line[: width - 3] + "..."


def library_versions(*distributions: str) -> dict[str, str]:
    """Installed versions of memfit, torch and the named distributions, for a key's parts.

    A compiled artifact is only valid for the exact library versions that produced it, so these
    belong in every compile key. A missing distribution is recorded as "absent" (not skipped), so
    installing it later changes the key.
    """
    from importlib import metadata

    versions = {}
    for name in ("memfit", "torch", *distributions):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def compile_key(
    *,
    weights_fingerprint: str,
    input_signature: Any,
    backend: str,
    backend_options: Mapping[str, Any] | None = None,
    graph: str | None = None,
    config: Any = None,
    backend_distributions: tuple[str, ...] = (),
    kind: str = "compiled",
) -> CacheKey:
    """The key of a compiled artifact: everything that, if changed, changes the artifact."""
    if not isinstance(weights_fingerprint, str) or not weights_fingerprint:
        raise MemfitError(
            "compile_key needs a non-empty weights fingerprint string (from memfit's "
            f"fingerprint module); got {weights_fingerprint!r}."
        )
    return CacheKey(
        kind,
        {
            "weights": weights_fingerprint,
            "graph": graph,
            "config": config,
            "inputs": input_signature,
            "backend": backend,
            "backend_options": dict(backend_options or {}),
            "versions": library_versions(*backend_distributions),
            "platform": _platform_tag(),
        },
    )


def _platform_tag() -> str:
    # Compiled code is specific to the OS and CPU architecture it was built for.
    import platform

    return f"{platform.system().lower()}-{platform.machine().lower()}-{os.name}"
