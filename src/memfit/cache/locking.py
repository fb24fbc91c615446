"""One advisory file lock per cache key, so concurrent processes build a key only once.

The lock is an optimization, not the safety net: entries become visible by an atomic rename, so
even without the lock (a platform without flock, a network filesystem that ignores it) two writers
of the same key each leave either a complete entry or nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def key_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created if missing) for the with-block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            # Blocks until the other builder of this key is done; the kernel releases the lock
            # if that process dies, so a killed builder never leaves a stuck lock.
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        # Closing the descriptor releases the flock.
        os.close(fd)
