"""Content fingerprints of model components: every byte, read once per version of a large file.

A fingerprint covers every file of a component folder (configs, tokenizer files, weights in any format)
by its relative path and the sha256 of its bytes, and a component of a single-file checkpoint by the
names, dtypes, shapes and bytes of the tensors it reads there. Never by size alone (every fine-tune of
one architecture has the same size), nor by sampled blocks (a change to a few tensors can miss every
sample). Part names ("unet", "vae") never enter a fingerprint: the same weights under
two names fingerprint the same.

Reading every byte of a multi-gigabyte model costs seconds (docs/backends.md, "The cache"), so what is
read from more than STORED_DIGEST_BYTES of a file is digested once per version of the file and kept
(memfit.cache.file_hash); smaller files are read on every run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO

from memfit.cache.file_hash import file_digest, file_sha256

FINGERPRINT_VERSION = "4"  # 4: every byte of large files too, not sampled blocks
STORED_DIGEST_BYTES = 64 * 1024 * 1024
_BLOCK = 1 << 20


def _sha256(path: Path) -> str:
    if path.stat().st_size > STORED_DIGEST_BYTES:
        return file_sha256(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fingerprint_folder(folder: str | Path) -> str:
    """Hex digest over every file in `folder` (recursively), by relative path and content."""
    folder = Path(folder)
    digest = hashlib.sha256(f"memfit-fingerprint/{FINGERPRINT_VERSION}".encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        digest.update(b"\0" + relative.encode() + b"\0" + _sha256(path).encode())
    return digest.hexdigest()


def fingerprint_path(path: str | Path) -> str:
    """A folder's fingerprint, or the sha256 of a file's bytes."""
    path = Path(path)
    return fingerprint_folder(path) if path.is_dir() else _sha256(path)


def _tensors_digest(handle: BinaryIO, keys: list[str]) -> str:
    """Names, dtypes, shapes and every byte of the tensors ``keys`` of the safetensors file open in ``handle``.
    Its header is read here, within the digest's computation: a file replaced meanwhile is not kept
    (memfit.cache.file_hash)."""
    from memfit.safetensors_header import read_header

    header = read_header(handle.name)
    digest = hashlib.sha256()
    for key in keys:
        entry = header.entries[key]
        digest.update(json.dumps([key, entry["dtype"], entry["shape"]]).encode())
        begin, end = entry["data_offsets"]
        handle.seek(header.data_start + begin)
        left = end - begin
        while left and (block := handle.read(min(_BLOCK, left))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def fingerprint_tensors(path: str | Path, keys, extra: bytes = b"") -> str:
    """Hex digest over the tensors ``keys`` of the safetensors file ``path``: their names, dtypes, shapes and
    every byte, in name order, and ``extra`` (a config's text). The same tensors in another file, or in
    another order, digest the same: what a component of an all-in-one checkpoint reads, not where the file
    keeps it."""
    from memfit.safetensors_header import read_header

    keys = sorted(keys)
    entries = read_header(path).entries
    size = sum(entries[key]["data_offsets"][1] - entries[key]["data_offsets"][0] for key in keys)
    if size > STORED_DIGEST_BYTES:
        listing = hashlib.sha256("\0".join(keys).encode()).hexdigest()
        tensors = file_digest(path, f"tensors:{listing}", lambda handle: _tensors_digest(handle, keys))
    else:
        with Path(path).open("rb") as handle:
            tensors = _tensors_digest(handle, keys)
    return hashlib.sha256(f"memfit-tensors/{FINGERPRINT_VERSION}".encode() + extra + tensors.encode()).hexdigest()


def combine_fingerprints(parts) -> str:
    """One digest over several component fingerprints, independent of the names they are stored under."""
    digest = hashlib.sha256(b"memfit-components")
    for part in sorted(parts):
        digest.update(part.encode())
    return digest.hexdigest()
