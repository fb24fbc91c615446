"""Content fingerprints of model components, cheap enough to take on every run.

A fingerprint covers a component folder's configs and tokenizer files in full, and each
safetensors file's header (names, dtypes, shapes, offsets), size, and its data: all of it for
files up to FULL_HASH_LIMIT bytes, otherwise SAMPLES evenly spaced blocks. Sampling keeps a
multi-gigabyte encoder at milliseconds instead of seconds; any fine-tune or re-initialisation
changes bytes everywhere, so sampled blocks catch it. Part names ("unet", "vae") never enter a
fingerprint: the same weights under two names fingerprint the same.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FINGERPRINT_VERSION = "2"
FULL_HASH_LIMIT = 64 * 1024 * 1024
SAMPLES = 64
SAMPLE_BYTES = 64 * 1024


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
    data_len = max(size - header.data_start, 0)
    with path.open("rb") as handle:
        handle.seek(header.data_start)
        if size <= FULL_HASH_LIMIT:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
            return
        step = max(data_len // SAMPLES, 1)
        for index in range(SAMPLES):
            handle.seek(header.data_start + index * step)
            digest.update(handle.read(SAMPLE_BYTES))


def fingerprint_folder(folder: str | Path) -> str:
    """Hex digest over every file in `folder` (recursively), by relative path and content."""
    folder = Path(folder)
    digest = hashlib.sha256(f"memfit-fingerprint/{FINGERPRINT_VERSION}".encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        digest.update(b"\0" + relative.encode() + b"\0")
        if path.suffix == ".safetensors":
            _hash_safetensors(path, digest)
        elif path.suffix in {".bin", ".pt", ".ckpt", ".pth", ".gguf"}:
            digest.update(str(path.stat().st_size).encode())
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def combine_fingerprints(parts) -> str:
    """One digest over several component fingerprints, independent of the names they are stored under."""
    digest = hashlib.sha256(b"memfit-components")
    for part in sorted(parts):
        digest.update(part.encode())
    return digest.hexdigest()
