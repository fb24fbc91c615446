"""The one reader of safetensors headers: tensor entries, where the data starts, the raw bytes.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the data. Validation (models.folder), content fingerprints
(cache.fingerprint) and memory-mapped weights (run.offload, models.single_file) all read it here;
``MappedFile`` is the one memory map of a file's tensors.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.errors import MemfitError

__all__ = ["TORCH_DTYPES", "LazyMapping", "MappedFile", "SafetensorsHeader", "check_complete", "close_unused_mappings",
           "SAMPLE_COUNT", "read_header", "same_samples", "sample_starts"]

#: The torch dtype of each safetensors dtype name memfit maps into memory.
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    # fp8 weights (Comfy's *_fp8_e4m3fn files) are held in their bytes and dequantized per layer: memfit.quant.
    **{name: getattr(torch, attr) for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
       if hasattr(torch, attr)},
}

_FIX = "re-download or re-save the model"


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    size: int  # of the whole file
    raw: bytes  # the 8-byte length and the JSON header, exactly as stored
    entries: dict[str, dict]  # tensor name -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return len(self.raw)

    @property
    def data_end(self) -> int:
        """Where the last tensor's bytes end (relative to the file's start)."""
        return self.data_start + max((entry["data_offsets"][1] for entry in self.entries.values()), default=0)


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and check ``path``'s header; a truncated or corrupt file raises MemfitError naming it."""
    path = Path(path)
    if not path.is_file():  # a device (a link to /dev/zero), a fifo or a folder: its size means nothing
        raise MemfitError(f"{path} is not a regular file (a device, pipe or folder); {_FIX}.")
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise MemfitError(f"{path} is truncated ({size} bytes, no safetensors header); {_FIX}.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise MemfitError(f"{path} is truncated or corrupt: its header claims {header_len} bytes but the file has {size}; {_FIX}.")
        header_bytes = handle.read(header_len)
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MemfitError(f"{path} has a corrupt safetensors header; {_FIX}.") from None
    if not isinstance(header, dict):
        raise MemfitError(f"{path} has a corrupt safetensors header; {_FIX}.")
    metadata = header.pop("__metadata__", None) or {}
    return SafetensorsHeader(path, size, prefix + header_bytes, header, metadata)


def check_complete(path: str | Path) -> SafetensorsHeader:
    """``read_header``, and raise if the file is shorter than its header says."""
    header = read_header(path)
    if header.size < header.data_end:
        raise MemfitError(f"{path} is truncated: {header.size} bytes where its header needs {header.data_end}; {_FIX}.")
    return header


class LazyMapping:
    """A weights file (``path``), memory-mapped once, on first use: reading its header alone maps nothing.

    The mapping is private copy-on-write (``ACCESS_COPY``): pages are the page cache's own, the
    kernel may drop and re-read them under pressure, and an accidental in-place write to a weight
    makes a private page instead of corrupting the model file (or crashing on a read-only page).

    The pages a process has touched in a mapping count in its resident set for as long as the mapping
    is open, whoever holds the file object: a model file read for one stage (a checkpoint's text
    encoder, a quantized UNet's blocks) would go on counting in every later stage's memory. So a
    mapping that no tensor shows any more is closed between stages (``close_unused_mappings``) and
    mapped again when a tensor is next asked for.
    """

    path: Path
    _mapping: mmap.mmap | None = None
    _descriptor: int | None = None  # the file the mapping shows, kept open for check_holds
    _close_descriptor: weakref.finalize | None = None
    _unshown_references = 0  # the mapping's reference count with no tensor showing it

    @property
    def mapping(self) -> mmap.mmap:
        if self._mapping is None:
            descriptor = os.open(self.path, os.O_RDONLY)
            try:
                self._mapping = mmap.mmap(descriptor, 0, access=mmap.ACCESS_COPY)
            except BaseException:
                os.close(descriptor)
                raise
            self._descriptor = descriptor
            self._close_descriptor = weakref.finalize(self, os.close, descriptor)
            self._unshown_references = self._mapping_references()
            _OPEN_MAPPINGS.add(self)
        return self._mapping

    def _mapping_references(self) -> int:
        # Counted the same way when the mapping opens and when it may close: only the difference matters.
        return sys.getrefcount(self._mapping)

    def close_if_unused(self) -> bool:
        """Let the mapping go where nothing but this object refers to it; returns whether it went.

        A tensor made by torch.frombuffer holds a reference to the mmap object, not a buffer export, so
        ``mmap.close`` would succeed under a live view and leave it pointing at unmapped memory. The mapping
        is never closed explicitly: this object's reference is dropped, and the mmap unmaps itself when the
        last reference goes, so a view that appears meanwhile keeps it valid. The reference count (a view's,
        a MappedPages') is checked first so that a file in use is not mapped twice."""
        if self._mapping is None or self._mapping_references() > self._unshown_references:
            return False
        self._mapping = None
        closing, self._close_descriptor, self._descriptor = self._close_descriptor, None, None
        if closing is not None:
            closing()  # the mmap object, now unreferenced, unmapped itself; its descriptor goes too
        _OPEN_MAPPINGS.discard(self)
        return True

    def check_holds(self, end: int) -> None:
        """Raise MemfitError naming the file when the file the mapping shows no longer reaches byte ``end``: a
        page of the mapping past a file's end kills the process (SIGBUS) when touched, so a block is checked
        before it is read from the map."""
        self.mapping  # opens the descriptor
        size = os.fstat(self._descriptor).st_size
        if size < end:
            raise MemfitError(
                f"{self.path} was cut short while memfit was reading it: it has {size} bytes now, and memfit needs "
                f"bytes up to {end}. Was it overwritten or copied over during the run? Let the copy or download "
                "finish, then run again.")


_OPEN_MAPPINGS: weakref.WeakSet[LazyMapping] = weakref.WeakSet()


def close_unused_mappings() -> int:
    """Close every open weights-file mapping no tensor shows any more (LazyMapping.close_if_unused), so
    the pages read from it leave this process's resident set (they stay in the page cache); returns how
    many were closed. Run after garbage collection, between stages."""
    return sum(lazy.close_if_unused() for lazy in list(_OPEN_MAPPINGS))


class MappedFile(LazyMapping):
    """One safetensors file, memory-mapped once (LazyMapping); ``tensor(key)`` is a zero-copy view of its bytes."""

    def __init__(self, path: str | Path, header: SafetensorsHeader | None = None):
        self.path = Path(path)
        self.header = header if header is not None else read_header(self.path)

    @property
    def entries(self) -> dict[str, dict]:
        return self.header.entries

    def byte_range(self, key: str) -> tuple[int, int]:
        """Where ``key``'s bytes lie in the file (absolute offsets, end excluded)."""
        begin, end = self.entries[key]["data_offsets"]
        return self.header.data_start + begin, self.header.data_start + end

    def dtype(self, key: str) -> torch.dtype:
        entry = self.entries[key]
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None and entry["dtype"].startswith("F8_"):
            raise MemfitError(f"{self.path} stores {key} as {entry['dtype']} (fp8), and this torch "
                              f"{torch.__version__} has no fp8 dtypes: install torch 2.1 or newer.")
        if dtype is None:
            raise MemfitError(f"{self.path} stores {key} as {entry['dtype']}, which memfit cannot memory-map.")
        return dtype

    def tensor(self, key: str) -> torch.Tensor:
        """A view of ``key`` in the mapped file (a tensor of its own where it has no bytes)."""
        dtype, shape = self.dtype(key), self.entries[key]["shape"]
        begin, end = self.byte_range(key)
        count = (end - begin) // dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.mapping, dtype=dtype, count=count, offset=begin).view(shape)


SAMPLE_COUNT = 4096  # elements same_samples compares at each of its places


def sample_starts(size: int, count: int = SAMPLE_COUNT) -> set[int]:
    """Where same_samples compares ``count`` elements of a tensor of ``size`` elements: start, middle and end."""
    return {0, max(0, size // 2 - count // 2), max(0, size - count)}


def same_samples(view: torch.Tensor, loaded: torch.Tensor, count: int = SAMPLE_COUNT) -> bool:
    """Whether a file's tensor (``view``, any dtype) and the loaded one agree at the start, middle and end.

    A changed model (a fused LoRA, a merged or requantized weight) changes values everywhere, so
    samples catch it; comparing every element would read the whole model again while loading, which
    is exactly the memory peak that mapping the file exists to avoid.
    """
    flat_view, flat_loaded = view.reshape(-1), loaded.reshape(-1)
    for start in sample_starts(flat_view.numel(), count):
        part = slice(start, start + count)
        if not torch.equal(flat_view[part].to(loaded.dtype), flat_loaded[part].cpu()):
            return False
    return True
