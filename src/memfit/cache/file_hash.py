"""A whole file's sha256, computed once per version of the file.

AUTOMATIC1111 names a checkpoint by the sha256 of its bytes ("name [first 10 hex digits]"). Reading
a multi-gigabyte checkpoint takes seconds to minutes, so the digest is kept in memfit's store, keyed
by the file's absolute path, size and modification time: it is read again only when the file
changes (a file rewritten in place gets a new modification time, and so a new key).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from memfit.cache.key import CacheKey
from memfit.cache.store import BLOB_NAME, CacheStore
from memfit.errors import MemfitError

__all__ = ["file_sha256", "stored_sha256"]

KIND = "file-sha256"
BLOCK = 1 << 20


def _key(path: Path) -> CacheKey:
    stat = path.stat()
    return CacheKey(KIND, {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})


def stored_sha256(path: str | Path) -> str | None:
    """The digest the store holds for ``path`` as it is now, or None; reads nothing of the file itself."""
    try:
        found = CacheStore().get(_key(Path(path)))
    except MemfitError:  # MEMFIT_CACHE=require: a digest is not a build to require; the caller computes it
        return None
    except OSError:  # the file went away
        return None
    return (found / BLOB_NAME).read_text().strip() if found is not None else None


def file_sha256(path: str | Path) -> str:
    """The sha256 of ``path``'s bytes (hex), from the store when it holds this version of the file, else read
    in full and stored."""
    path = Path(path)
    known = stored_sha256(path)
    if known is not None:
        return known
    key = _key(path)  # taken before reading: a file changed meanwhile is keyed as it was, so it is read again
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    value = digest.hexdigest()
    CacheStore().put(key, value.encode())
    return value
