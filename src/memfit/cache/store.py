"""The one on-disk, content-addressed store: compiled artifacts, prompt embeddings, anything keyed.

Layout under the root::

    <kind>/<2 hex>/<digest>/manifest.json   key parts, created time, size and sha256 of each file
    <kind>/<2 hex>/<digest>/data/...        the entry's files (what get() returns; read-only)
    <kind>/<2 hex>/<digest>/last_used       empty; its mtime is the last use, for LRU eviction
    .tmp/<host>-<pid>-<random>/             entries being written (same filesystem as the root)
    .locks/<digest>.lock                    one flock per key, held while building it

Guarantees, each with a test in tests/test_cache_store.py:

* An entry appears whole or not at all: it is written into .tmp, fsynced, then renamed into
  place. A writer killed at any point leaves at most a staging directory, which nobody loads.
* Two processes filling one key at once both get a valid entry; one build wins (a key lock makes
  the second wait and reuse the first one's result).
* An entry is loaded only after every file matches its manifest's size and sha256; a damaged
  entry is reported (a CacheCorruptionWarning naming it), removed and rebuilt.
* Past ``max_bytes`` the least recently used entries are evicted (never the one just written),
  with the lock files of the keys they held.
* A store that cannot be read or written (a read-only directory, a file in its place, a full
  disk) never fails a run: lookups miss and builds go to a private temporary directory, with one
  CacheUnavailableWarning per store root naming it. Under MEMFIT_CACHE=require it is an error.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Union

from memfit.atomic import process_alive
from memfit.cache.key import CacheKey, summarize_parts
from memfit.cache.locking import fcntl, key_lock
from memfit.cache.manifest import (
    DATA_DIR_NAME,
    LAST_USED_NAME,
    MANIFEST_NAME,
    Manifest,
    data_files,
    describe_files,
    find_damage,
    fsync_dir,
    fsync_file,
)
from memfit.cache.settings import CacheMode, default_root, max_bytes_from_env, mode_from_env
from memfit.errors import MemfitError

# What put() accepts: raw bytes (stored as one file named "blob"), a path to a file or directory
# to copy in, or a mapping of relative file names to bytes or source paths.
PathLikeStr = Union[str, "os.PathLike[str]"]
Content = Union[bytes, PathLikeStr, Mapping[str, Union[bytes, PathLikeStr]]]
BLOB_NAME = "blob"

_STAGING_DIR = ".tmp"
_LOCKS_DIR = ".locks"


class CacheCorruptionWarning(UserWarning):
    """A cache entry failed its checksum or is incomplete; it was not loaded."""


class CacheUnavailableWarning(UserWarning):
    """The store cannot be read or written; the run goes on uncached."""


_warned_roots: set[str] = set()


@dataclass(frozen=True)
class CacheEntry:
    """One entry as `memfit cache ls` shows it."""

    kind: str
    digest: str
    path: Path
    size: int
    created: float
    last_used: float
    parts: dict[str, Any]
    meta: dict[str, Any]

    @property
    def summary(self) -> str:
        return summarize_parts(self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "digest": self.digest,
            "path": str(self.path),
            "size": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "summary": self.summary,
            "parts": self.parts,
            "meta": self.meta,
        }


@dataclass(frozen=True)
class BadEntry:
    """An entry that must not be loaded, and why."""

    kind: str
    digest: str
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.digest[:12]} at {self.path}: {self.reason}"


class CacheStore:
    """A content-addressed store rooted at one directory; see the module docstring for layout.

    Arguments default to the environment (MEMFIT_CACHE_DIR, MEMFIT_CACHE, MEMFIT_CACHE_MAX_BYTES),
    read once when the store is created.
    """

    def __init__(
        self,
        root: PathLikeStr | None = None,
        *,
        max_bytes: int | None = None,
        mode: CacheMode | str | None = None,
    ) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.max_bytes = max_bytes_from_env() if max_bytes is None else int(max_bytes)
        if self.max_bytes <= 0:
            raise MemfitError(f"The cache size limit must be positive; got {self.max_bytes} bytes.")
        self.mode = mode_from_env() if mode is None else CacheMode(mode)
        self._tags: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"CacheStore(root={str(self.root)!r}, max_bytes={self.max_bytes}, mode={self.mode.value!r})"

    def tagged(self, **meta: Any) -> CacheStore:
        """This store, writing ``meta`` into the manifest of every entry built or loaded through it: what
        a caller can find entries by (``ls``, each entry's ``meta``) before it can know their keys."""
        view = copy.copy(self)
        view._tags = {**self._tags, **meta}
        return view

    # -- lookups -------------------------------------------------------------------------------

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / key.kind / key.digest[:2] / key.digest

    def get(self, key: CacheKey) -> Path | None:
        """The data directory of an intact entry for ``key``, or None on a miss.

        With MEMFIT_CACHE=0 every lookup misses; with MEMFIT_CACHE=require a miss raises.
        """
        if self.mode is CacheMode.OFF:
            return None
        try:
            found = self._load(key)
        except OSError as exc:
            self._unavailable(exc)
            found = None
        if found is not None and self._tags:
            self._add_tags(key, found.parent)
        if found is None and self.mode is CacheMode.REQUIRE:
            raise MemfitError(
                f"Cache miss for {key} under {self.root}, and MEMFIT_CACHE=require forbids "
                "building it. Run once without MEMFIT_CACHE=require (same inputs, same library "
                "versions) to fill the cache, or check that MEMFIT_CACHE_DIR points at it."
            )
        return found

    def contains(self, key: CacheKey) -> bool:
        """Whether an entry exists for ``key`` (without checking its contents or counting a use)."""
        return (self.entry_dir(key) / MANIFEST_NAME).is_file()

    def _load(self, key: CacheKey) -> Path | None:
        entry = self.entry_dir(key)
        if not (entry / MANIFEST_NAME).exists():
            return None
        damage = find_damage(entry, key.digest)
        if damage is not None:
            # Re-check under the key's lock: a concurrent writer may have just replaced it.
            with key_lock(self._lock_path(key)):
                damage = find_damage(entry, key.digest)
                if damage is not None:
                    warnings.warn(
                        f"memfit cache entry {key.short} at {entry} is damaged ({damage}); it was "
                        "not loaded and is removed so it can be rebuilt. If this repeats, check "
                        "the disk, or run `memfit cache verify`.",
                        CacheCorruptionWarning,
                        stacklevel=3,
                    )
                    self._discard(entry)
                    return None
        _touch(entry / LAST_USED_NAME)
        return entry / DATA_DIR_NAME

    def _add_tags(self, key: CacheKey, entry: Path) -> None:
        """Write this view's tags into the manifest of an entry stored without them (by a memfit from before
        they existed), so that lookups by tag find it from now on. The manifest is replaced by a rename, as
        an entry is; a store that cannot be written keeps the entry as it is."""
        try:
            manifest = Manifest.from_json((entry / MANIFEST_NAME).read_text(encoding="utf-8"))
            if all(manifest.meta.get(name) == value for name, value in self._tags.items()):
                return
            staging = self._new_staging_dir()
            try:
                updated = dataclasses.replace(manifest, meta={**manifest.meta, **self._tags})
                (staging / MANIFEST_NAME).write_text(updated.to_json(), encoding="utf-8")
                fsync_file(staging / MANIFEST_NAME)
                with key_lock(self._lock_path(key)):
                    os.replace(staging / MANIFEST_NAME, entry / MANIFEST_NAME)
                fsync_dir(entry)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: CacheKey, content: Content, meta: Mapping[str, Any] | None = None) -> Path | None:
        """Store ``content`` under ``key``; returns the entry's data directory (None when off).

        If an intact entry for the key already exists it is kept (same key, same content).
        """
        if self.mode is CacheMode.OFF:
            return None

        def copy_in(out_dir: Path) -> Mapping[str, Any] | None:
            _write_content(content, out_dir, key)
            return meta

        try:
            with key_lock(self._lock_path(key)):
                existing = self._load(key)
                if existing is not None:
                    return existing
                return self._build_and_commit(key, copy_in)
        except OSError as exc:
            self._unavailable(exc)
            return None

    def get_or_build(self, key: CacheKey, build: Callable[[Path], Mapping[str, Any] | None]) -> Path:
        """Return the entry for ``key``, building it first on a miss.

        ``build(out_dir)`` writes the entry's files into ``out_dir`` (an empty directory on the
        cache's filesystem, so large artifacts are never copied) and may return a JSON-able dict
        of metadata for the manifest. Concurrent callers with the same key build it once.
        With MEMFIT_CACHE=0 the result lives in a private temporary directory removed at exit.
        """
        found = self.get(key)  # raises on a miss under MEMFIT_CACHE=require
        if found is not None:
            return found
        if self.mode is CacheMode.OFF:
            return _build_uncached(key, build)
        try:
            with key_lock(self._lock_path(key)):
                # Another process may have built it while we waited for the lock.
                found = self._load(key)
                if found is not None:
                    return found
                return self._build_and_commit(key, build)
        except OSError as exc:
            self._unavailable(exc)
            return _build_uncached(key, build)

    def _unavailable(self, exc: OSError) -> None:
        """A store fault: an error under MEMFIT_CACHE=require, else one warning per root and go on uncached."""
        reason = f"{exc.strerror or type(exc).__name__}" + (f": {exc.filename}" if exc.filename else "")
        if self.mode is CacheMode.REQUIRE:
            raise MemfitError(
                f"The memfit cache at {self.root} cannot be used ({reason}), and MEMFIT_CACHE=require forbids "
                "running uncached; point MEMFIT_CACHE_DIR at a writable directory holding the cache."
            ) from exc
        if str(self.root) not in _warned_roots:
            _warned_roots.add(str(self.root))
            warnings.warn(
                f"memfit cache at {self.root} cannot be used ({reason}); running uncached. Point MEMFIT_CACHE_DIR "
                "at a writable directory, or set MEMFIT_CACHE=0 to silence this.",
                CacheUnavailableWarning,
                stacklevel=4,
            )

    def _build_and_commit(self, key: CacheKey, build: Callable[[Path], Mapping[str, Any] | None]) -> Path:
        """Build into a staging directory and rename it into place. Caller holds the key lock."""
        staging = self._new_staging_dir()
        try:
            data_dir = staging / DATA_DIR_NAME
            data_dir.mkdir()
            meta = build(data_dir)
            if meta is None:
                meta = {}
            if not isinstance(meta, Mapping):
                raise MemfitError(
                    f"The builder for cache entry {key} returned {type(meta).__name__}; a builder "
                    "returns a dict of metadata for the manifest, or None."
                )
            if not data_files(data_dir):
                raise MemfitError(
                    f"The builder for cache entry {key} wrote no files into {data_dir}; "
                    "a builder must write the entry's files into the directory it is given."
                )
            return self._commit(key, staging, {**meta, **self._tags})
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def _commit(self, key: CacheKey, staging: Path, meta: dict[str, Any]) -> Path:
        data_dir = staging / DATA_DIR_NAME
        # Contents must be on disk before the manifest that vouches for them, and both before the
        # rename that publishes them; otherwise a power cut could leave a valid-looking entry.
        for name in data_files(data_dir):
            fsync_file(data_dir / name)
        manifest = Manifest(
            kind=key.kind,
            digest=key.digest,
            parts=dict(key.parts),
            files=describe_files(data_dir),
            created=time.time(),
            meta=meta,
        )
        try:
            text = manifest.to_json()
        except TypeError as exc:
            raise MemfitError(f"Metadata for cache entry {key} must be JSON values: {exc}.") from None
        manifest_path = staging / MANIFEST_NAME
        manifest_path.write_text(text, encoding="utf-8")
        fsync_file(manifest_path)
        _touch(staging / LAST_USED_NAME)
        fsync_dir(data_dir)
        fsync_dir(staging)

        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            if find_damage(final, key.digest) is None:
                return final / DATA_DIR_NAME  # an intact twin won; ours is dropped by the caller
            self._discard(final)
        os.rename(staging, final)
        fsync_dir(final.parent)
        self._evict_to_limit(keep=final)
        return final / DATA_DIR_NAME

    # -- maintenance ---------------------------------------------------------------------------

    def ls(self, kind: str | None = None) -> list[CacheEntry]:
        """Every entry (intact or not, contents not checked), most recently used first."""
        entries = []
        for entry_dir in self._entry_dirs(kind):
            try:
                manifest = Manifest.from_json((entry_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                manifest = None
            entries.append(_entry_from(entry_dir, manifest))
        return sorted(entries, key=lambda e: e.last_used, reverse=True)

    def verify(self, kind: str | None = None, *, remove_bad: bool = False) -> list[BadEntry]:
        """Re-check every entry's files against its manifest; return the damaged ones."""
        bad = []
        for entry_dir in self._entry_dirs(kind):
            damage = find_damage(entry_dir, entry_dir.name, rehash=True)
            if damage is not None:
                bad.append(BadEntry(entry_dir.parent.parent.name, entry_dir.name, entry_dir, damage))
                if remove_bad:
                    self._discard(entry_dir)
        return bad

    def clear(self, kind: str | None = None) -> int:
        """Remove every entry (of ``kind``, if given) and abandoned staging dirs; returns the count."""
        removed = 0
        for entry_dir in self._entry_dirs(kind):
            self._discard(entry_dir)
            removed += 1
        self._remove_abandoned_staging()
        self._prune_locks()
        return removed

    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.ls())

    # -- internals -----------------------------------------------------------------------------

    def _lock_path(self, key: CacheKey) -> Path:
        return self.root / _LOCKS_DIR / f"{key.kind}-{key.digest}.lock"

    def _entry_dirs(self, kind: str | None):
        if kind is not None:
            CacheKey(kind, {})  # validates the kind, so "--kind ../.." can never leave the root
        if not self.root.is_dir():
            return
        kinds = [self.root / kind] if kind else sorted(self.root.iterdir())
        for kind_dir in kinds:
            if kind_dir.name.startswith(".") or not kind_dir.is_dir():
                continue
            for shard in sorted(kind_dir.iterdir()):
                if not shard.is_dir():
                    continue
                for entry_dir in sorted(shard.iterdir()):
                    if entry_dir.is_dir() and len(entry_dir.name) == 64:
                        yield entry_dir

    def _new_staging_dir(self) -> Path:
        staging_root = self.root / _STAGING_DIR
        staging_root.mkdir(parents=True, exist_ok=True)
        self._remove_abandoned_staging()
        path = staging_root / f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        return path

    def _remove_abandoned_staging(self) -> None:
        """Remove staging dirs whose writer died (killed mid-write); they are never loaded anyway."""
        staging_root = self.root / _STAGING_DIR
        if not staging_root.is_dir():
            return
        for path in staging_root.iterdir():
            if _writer_is_gone(path):
                shutil.rmtree(path, ignore_errors=True)

    def _prune_locks(self) -> None:
        """Remove the lock files of keys that have no entry and that nobody holds, so .locks does
        not keep one file per key ever built. A lock in use is left alone (taken without waiting);
        the lock is an optimization, entries stay whole by their atomic rename either way."""
        locks = self.root / _LOCKS_DIR
        if fcntl is None or not locks.is_dir():
            return
        for lock in locks.glob("*.lock"):
            kind, _, digest = lock.stem.rpartition("-")
            if len(digest) == 64 and (self.root / kind / digest[:2] / digest).exists():
                continue
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.unlink()
            except OSError:
                pass  # held by a builder right now
            finally:
                os.close(fd)

    def _discard(self, entry_dir: Path) -> None:
        """Remove an entry so that readers see it either whole or absent, never half-deleted."""
        staging_root = self.root / _STAGING_DIR
        staging_root.mkdir(parents=True, exist_ok=True)
        trash = staging_root / f"{_host()}-{os.getpid()}-trash-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(entry_dir, trash)
        except FileNotFoundError:
            return  # someone else removed it first
        shutil.rmtree(trash, ignore_errors=True)

    def _evict_to_limit(self, keep: Path) -> None:
        entries = self.ls()
        total = sum(e.size for e in entries)
        if total <= self.max_bytes:
            return
        for entry in sorted(entries, key=lambda e: e.last_used):
            if total <= self.max_bytes:
                break
            if entry.path == keep:
                continue
            self._discard(entry.path)
            total -= entry.size
        self._prune_locks()
        if total > self.max_bytes:
            warnings.warn(
                f"memfit cache entry at {keep} alone is larger than the cache limit "
                f"({self.max_bytes} bytes); it is kept, but raise MEMFIT_CACHE_MAX_BYTES so that "
                "it is not evicted by the next write.",
                stacklevel=4,
            )


def _entry_from(entry_dir: Path, manifest: Manifest | None) -> CacheEntry:
    kind = entry_dir.parent.parent.name
    if manifest is None:
        # An unreadable entry still shows up (and counts toward the limit) so it can be evicted.
        data = entry_dir / DATA_DIR_NAME
        size = sum((data / n).stat().st_size for n in data_files(data)) if data.is_dir() else 0
        return CacheEntry(kind, entry_dir.name, entry_dir, size, 0.0, 0.0, {}, {"damaged": True})
    return CacheEntry(
        kind=kind,
        digest=entry_dir.name,
        path=entry_dir,
        size=manifest.size,
        created=manifest.created,
        last_used=_mtime(entry_dir / LAST_USED_NAME, default=manifest.created),
        parts=manifest.parts,
        meta=manifest.meta,
    )


def _write_content(content: Content, out_dir: Path, key: CacheKey) -> None:
    if isinstance(content, (bytes, bytearray, memoryview)):
        (out_dir / BLOB_NAME).write_bytes(bytes(content))
        return
    if isinstance(content, Mapping):
        for name, value in content.items():
            target = (out_dir / name).resolve()
            if out_dir.resolve() not in target.parents:
                raise MemfitError(
                    f"File name {name!r} for cache entry {key} leaves the entry directory; "
                    "use relative names without '..'."
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(value, (bytes, bytearray, memoryview)):
                target.write_bytes(bytes(value))
            else:
                _copy_path(Path(value), target, key)
        return
    source = Path(content)
    _copy_path(source, out_dir / source.name, key)


def _copy_path(source: Path, target: Path, key: CacheKey) -> None:
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    elif source.is_file():
        shutil.copyfile(source, target)
    else:
        raise MemfitError(f"Cannot store {source} in cache entry {key}: no such file or directory.")


_uncached_dirs: list[str] = []


def _build_uncached(key: CacheKey, build: Callable[[Path], Any]) -> Path:
    if not _uncached_dirs:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _uncached_dirs])
    path = tempfile.mkdtemp(prefix=f"memfit-nocache-{key.kind}-")
    _uncached_dirs.append(path)
    build(Path(path))
    return Path(path)


def _touch(path: Path) -> None:
    try:
        os.utime(path, None)
    except FileNotFoundError:
        path.touch()
    except OSError:
        pass  # a read-only cache still serves hits; only LRU ordering suffers


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return default


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _writer_is_gone(staging: Path) -> bool:
    """True for a staging dir whose writing process no longer exists (or is very old)."""
    host, _, rest = staging.name.partition("-")
    pid_text = rest.partition("-")[0]
    try:
        age = time.time() - staging.stat().st_mtime
    except OSError:
        return False
    if host != _host() or not pid_text.isdigit():
        # Another machine sharing this cache: we cannot see its processes; trust only age.
        return age > 24 * 3600
    return not process_alive(int(pid_text))
