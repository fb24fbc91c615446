"""Atomic file writes: a crash or an error leaves the old file or none, never a partial one.

The temporary file sits beside the target (same filesystem, so the rename is atomic) and is named
``.NAME.memfit-PID-XXXX.tmp``. A process killed mid-write cannot remove its own; the next write
into that directory removes every one whose process is gone, and only ours (the ``memfit-PID``
mark), never another program's temporary files.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from memfit.errors import MemfitError

_OURS = re.compile(r"^\..+\.memfit-(\d+)-[^.]+\.tmp$")


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove the temporary files memfit writers left in ``folder`` when killed; returns them."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _OURS.match(name)
        if match is None or process_alive(int(match.group(1))):
            continue
        path = Path(folder) / name
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (this one included; another user's counts too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def check_writable(path: str | Path, what: str = "--out") -> Path:
    """Raise, naming ``path``, unless a file can be written there: its folder exists, is a folder
    and is writable, and ``path`` itself is not a folder. Checked before any work starts."""
    path = Path(path)
    if path.is_dir():
        raise MemfitError(f"{what} {path} is a folder; give a file name.")
    parent = path.parent
    for ancestor in [parent, *parent.parents]:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise MemfitError(f"{what} {path} is under {ancestor}, which is a file, not a folder; choose another path.")
            break
    if not parent.exists():
        raise MemfitError(f"{what} {path}: the folder {parent} does not exist; create it first or choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MemfitError(f"{what} {path}: the folder {parent} is not writable; choose another path.")
    return path


def write_atomically(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_path)` on a temporary file beside `path`, then rename it into place.

    The result gets the permissions an ordinary new file would (0666 less the umask), not the
    0600 that temporary files are created with. A failure to write (a full disk, a folder that
    became read-only) is a MemfitError naming ``path``.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.memfit-{os.getpid()}-", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise MemfitError(f"Cannot write {path}: {exc.strerror or exc}; choose another path.") from exc
    os.close(fd)
    try:
        try:
            write(tmp)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, path)
        except OSError as exc:
            raise MemfitError(
                f"Could not write {path}: {exc.strerror or exc}; free some space or choose another path."
            ) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
