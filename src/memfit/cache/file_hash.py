"""Digests of a file's bytes, each computed once per version of the file.

Reading a multi-gigabyte file takes seconds, so a digest is kept in memfit's store (and, for the rest of
the process, in memory), keyed by the file's absolute path and its stamp: size, modification and change
times in nanoseconds, inode and device (memfit.cache.manifest.file_stamp), as the store knows its own
files. The file is read again only when it changes: any write, truncation, copy or replacement changes
its change time, which no program can set back. A file changed within a second before it was read is not
kept (its times tick coarsely, so a later change could share them), nor one that changed while it was
read. With the store off (MEMFIT_CACHE=0) a digest lasts as long as the process.

Two users: AUTOMATIC1111 names a checkpoint by the sha256 of its bytes ("name [first 10 hex digits]",
memfit serve), and memfit's content fingerprints (memfit.cache.fingerprint) take a large weights file by
that same sha256, and a component of a single-file checkpoint by a digest of the tensors it reads there.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import BinaryIO, Callable

from memfit.cache.key import CacheKey
from memfit.cache.manifest import file_stamp, is_settled
from memfit.cache.store import BLOB_NAME, CacheStore
from memfit.errors import MemfitError

__all__ = ["file_digest", "file_sha256", "stored_sha256"]

KIND = "file-digest"
_BLOCK = 1 << 20  # bytes read at a time
SHA256 = "sha256"

_known: dict[tuple[str, tuple[int, ...], str], str] = {}  # (path, stamp, what) -> digest, this process


def _key(path: Path, stamp: list[int], what: str) -> CacheKey:
    return CacheKey(KIND, {"path": str(path), "stamp": stamp, "digest": what})


def _lookup(path: Path, stamp: list[int], what: str) -> str | None:
    known = _known.get((str(path), tuple(stamp), what))
    if known is not None:
        return known
    try:
        found = CacheStore().get(_key(path, stamp, what))
        return (found / BLOB_NAME).read_text().strip() if found is not None else None
    except MemfitError:  # MEMFIT_CACHE=require: a digest is not a build to require; the caller computes it
        return None
    except OSError:  # an entry evicted meanwhile
        return None


def file_digest(path: str | Path, what: str, compute: Callable[[BinaryIO], str]) -> str:
    """``compute`` (given the open file, returning a hex digest) of ``path`` as it is now: from this process's
    memory or the store when they hold it for this version of the file, else computed and kept. ``what``
    names the computation (one file has one digest per ``what``)."""
    path = Path(path).resolve()
    info = path.stat()
    stamp = file_stamp(info)
    known = _lookup(path, stamp, what)
    if known is not None:
        return known
    read_at = time.time_ns()
    with path.open("rb") as handle:
        value = compute(handle)
    if is_settled(info, read_at) and file_stamp(path.stat()) == stamp:
        _known[(str(path), tuple(stamp), what)] = value
        CacheStore().put(_key(path, stamp, what), value.encode())
    return value


def _sha256(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(_BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """The sha256 of ``path``'s bytes (hex), read in full once per version of the file."""
    return file_digest(path, SHA256, _sha256)


def stored_sha256(path: str | Path) -> str | None:
    """The sha256 known for ``path`` as it is now, or None; reads nothing of the file itself."""
    path = Path(path).resolve()
    try:
        stamp = file_stamp(path.stat())
    except OSError:  # the file went away
        return None
    return _lookup(path, stamp, SHA256)
