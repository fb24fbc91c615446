"""Atomic file writes: a crash or an error leaves the old file or none, never a partial one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_path)` on a temporary file beside `path`, then rename it into place.

    The result gets the permissions an ordinary new file would (0666 less the umask), not the
    0600 that temporary files are created with.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
