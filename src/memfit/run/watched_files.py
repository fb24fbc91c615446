"""The weight files a run reads, looked at before each stage and at each step for a change in place.

A weight used in place is a view of its file's pages (plain diffusers' loading maps safetensors files,
and memfit streams from them): a file cut short while a run maps it kills the process with SIGBUS at
the next touch of a page past its new end, and a file overwritten in place changes weights under the
run. Neither can be caught where it happens, so the run stops before it reads them again: before each
stage and at each denoising step it compares every file's size and modification time with what they
were when the run loaded it, and names the file that changed. A file replaced by another (a new inode
at the path, as a finished download or copy is renamed into place) or removed is not a change: the run
still maps the old one, which stays whole until it lets go. Blocks memfit streams from disk are read
with pread (memfit.run.offload.BlockReads), which a file cut short meanwhile answers with an error,
not a fault.
"""

from __future__ import annotations

import os
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["WatchedFiles"]


class WatchedFiles:
    def __init__(self):
        self._seen: dict[Path, os.stat_result] = {}

    def add(self, paths) -> None:
        """Watch ``paths`` from now (a path already watched keeps the state it was first seen in)."""
        for path in paths:
            path = Path(path)
            if path not in self._seen:
                try:
                    self._seen[path] = os.stat(path)
                except OSError:
                    continue  # not there: loading it says so

    def check(self) -> None:
        """Raise MemfitError naming the first watched file changed in place since it was added."""
        for path, was in self._seen.items():
            try:
                now = os.stat(path)
            except OSError:
                continue  # removed: the run's mapping still holds the file
            if (now.st_ino, now.st_dev) != (was.st_ino, was.st_dev):
                continue  # another file now has the name; the run's is unchanged
            if (now.st_size, now.st_mtime_ns) != (was.st_size, was.st_mtime_ns):
                change = (f"{was.st_size} -> {now.st_size} bytes" if now.st_size != was.st_size
                          else "written to, same size")
                raise MemfitError(
                    f"{path} changed while memfit was using it ({change}), so memfit stopped before reading its "
                    "weights again: a file cut short would crash the run, and one written to would mix two "
                    "models. Let the copy or download finish (or replace the file by renaming a finished "
                    "copy over it), then run again.")
