"""Content fingerprints of model components, cheap enough to take on every run.

A fingerprint covers a component folder's configs and tokenizer files in full, each
safetensors file's header (names, dtypes, shapes, offsets), size, and its data, and every other
weights file (pickle formats: .bin, .pt, .ckpt, .pth; .gguf) by size and content: all of it for
files up to FULL_HASH_LIMIT bytes, otherwise SAMPLES evenly spaced blocks. Size alone is never a
key: every fine-tune of one architecture has the same size. Sampling keeps a
multi-gigabyte encoder at milliseconds instead of seconds; any fine-tune or re-initialisation
changes bytes everywhere, so sampled blocks catch it. Part names ("unet", "vae") never enter a
fingerprint: the same weights under two names fingerprint the same.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FINGERPRINT_VERSION = "3"  # 3: pickle and gguf weights hashed by content, not size alone
FULL_HASH_LIMIT = 64 * 1024 * 1024
SAMPLES = 64
SAMPLE_BYTES = 64 * 1024
# Weights formats other than safetensors: hashed by sampled content like safetensors data.
WEIGHT_SUFFIXES = {".bin", ".pt", ".ckpt", ".pth", ".gguf"}


def _hash_safetensors(path: Path, digest: "hashlib._Hash") -> None:
    from memfit.errors import MemfitError
    from memfit.safetensors_header import read_header

    size = path.stat().st_size
    digest.update(str(size).encode())
    try:
        header = read_header(path)
    except MemfitError:  # a damaged file still fingerprints (by its bytes); loading it reports the damage
        digest.update(path.read_bytes()[: FULL_HASH_LIMIT])
        return
    digest.update(header.raw)
    _hash_data(path, header.data_start, size, digest)


def _hash_data(path: Path, start: int, size: int, digest: "hashlib._Hash") -> None:
    """Bytes ``start``..``size`` of ``path``: all of them for a small file, else SAMPLES evenly spaced blocks."""
    data_len = max(size - start, 0)
    with path.open("rb") as handle:
        handle.seek(start)
        if size <= FULL_HASH_LIMIT:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
            return
        step = max(data_len // SAMPLES, 1)
        for index in range(SAMPLES):
            handle.seek(start + index * step)
            digest.update(handle.read(SAMPLE_BYTES))
        handle.seek(max(size - SAMPLE_BYTES, start))
        digest.update(handle.read(SAMPLE_BYTES))  # the tail too: a pickle's index sits at its end


def fingerprint_folder(folder: str | Path) -> str:
    """Hex digest over every file in `folder` (recursively), by relative path and content."""
    folder = Path(folder)
    digest = hashlib.sha256(f"memfit-fingerprint/{FINGERPRINT_VERSION}".encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        digest.update(b"\0" + relative.encode() + b"\0")
        if path.suffix == ".safetensors":
            _hash_safetensors(path, digest)
        elif path.suffix in WEIGHT_SUFFIXES:
            size = path.stat().st_size
            digest.update(str(size).encode())
            _hash_data(path, 0, size, digest)
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint_tensors(path: str | Path, keys, extra: bytes = b"") -> str:
    """Hex digest over the tensors ``keys`` of the safetensors file ``path``: their names, dtypes, shapes and
    bytes (all of them up to FULL_HASH_LIMIT in total, else SAMPLES evenly spaced blocks across them, in name
    order), and ``extra`` (a config's text). The same tensors in another file, or in another order, digest
    the same: what a component of an all-in-one checkpoint reads, not where the file keeps it."""
    import bisect
    import json

    from memfit.safetensors_header import read_header

    header = read_header(path)
    digest = hashlib.sha256(f"memfit-tensors/{FINGERPRINT_VERSION}".encode() + extra)
    ranges = []
    for key in sorted(keys):
        entry = header.entries[key]
        digest.update(json.dumps([key, entry["dtype"], entry["shape"]]).encode())
        begin, end = entry["data_offsets"]
        ranges.append((header.data_start + begin, end - begin))
    total = sum(length for _, length in ranges)
    with Path(path).open("rb") as handle:
        if total <= FULL_HASH_LIMIT:
            for start, length in ranges:
                handle.seek(start)
                digest.update(handle.read(length))
            return digest.hexdigest()
        starts = [0]  # where each tensor begins in the tensors' bytes laid end to end
        for _, length in ranges[:-1]:
            starts.append(starts[-1] + length)
        for index in range(SAMPLES + 1):
            at = min(index * total // SAMPLES, total - 1)
            which = bisect.bisect_right(starts, at) - 1
            start, length = ranges[which]
            handle.seek(start + at - starts[which])
            digest.update(handle.read(min(SAMPLE_BYTES, length - (at - starts[which]))))
    return digest.hexdigest()


def combine_fingerprints(parts) -> str:
    """One digest over several component fingerprints, independent of the names they are stored under."""
    digest = hashlib.sha256(b"memfit-components")
    for part in sorted(parts):
        digest.update(part.encode())
    return digest.hexdigest()
