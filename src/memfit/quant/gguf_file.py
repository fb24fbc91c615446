"""A GGUF file, memory-mapped: its tensors as zero-copy views, as memfit maps a safetensors file.

GGUF (llama.cpp's format; city96's and stable-diffusion.cpp's files for diffusion models) stores each
tensor's dimensions innermost first and its data aligned, so a tensor is a view of the mapping: a
block-quantized one as its bytes (int8, the logical shape with the last dimension in bytes, as
memfit.quant.formats reads them), an F32, F16 or BF16 one as that dtype. The header is read by the
``gguf`` package (``pip install 'memfit[gguf]'``); the data is never copied (diffusers' GGUF loading
copies every tensor into memory).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.quant.formats import STORAGE_DTYPE, StoredFormat, gguf_format
from memfit.safetensors_header import LazyMapping

__all__ = ["MappedGguf"]

# GGUF's plain types, read as torch dtypes.
_PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise MemfitError(f"{path} is a GGUF file, and reading GGUF needs the gguf package: "
                          "pip install 'memfit[gguf]'.") from None
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the same thing to the user
        raise MemfitError(f"{path} is truncated or damaged: the gguf package cannot read it ({type(exc).__name__}: "
                          f"{exc}); re-download it or convert it again.") from None


class MappedGguf(LazyMapping):
    """One GGUF file: ``entries`` (key -> (logical shape, stored shape, dtype, byte range)), ``formats`` (the
    block-quantized keys' StoredFormat), ``tensor(key)`` a view of the mapping. The same interface as
    memfit.safetensors_header.MappedFile, so the disk tier maps it alike."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        reader = _reader(self.path)
        self.entries: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, tuple[int, int]]] = {}
        self.formats: dict[str, StoredFormat] = {}
        for tensor in reader.tensors:
            logical = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            where = f"Tensor {tensor.name!r} of {self.path}"
            quant_type = int(tensor.tensor_type)
            if quant_type in _PLAIN:
                dtype, stored = _PLAIN[quant_type], logical
            else:
                fmt = gguf_format(quant_type, where)
                if not fmt.fits(logical):
                    raise MemfitError(f"{where} has shape {list(logical)}, which is not whole {fmt.name} blocks of "
                                      f"{fmt.block_size} values; the file is damaged: re-download it.")
                self.formats[tensor.name] = fmt
                dtype, stored = STORAGE_DTYPE, fmt.stored_shape(logical)
            begin = int(tensor.data_offset)
            end = begin + int(tensor.n_bytes)
            expected = dtype.itemsize * math.prod(stored)
            if end - begin != expected:
                raise MemfitError(f"{where} holds {end - begin} bytes where its type and shape {list(logical)} need "
                                  f"{expected}; the file is damaged: re-download it.")
            if end > size:
                raise MemfitError(f"{self.path} is truncated: tensor {tensor.name!r} ends at byte {end}, past the "
                                  f"file's {size} bytes; re-download it.")
            self.entries[tensor.name] = (logical, stored, dtype, (begin, end))
        del reader  # its own numpy mapping is closed with it; tensors come from ours

    def byte_range(self, key: str) -> tuple[int, int]:
        return self.entries[key][3]

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][2]

    def logical_shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][0]

    def tensor(self, key: str) -> torch.Tensor:
        """A view of ``key``'s data in the mapped file: its bytes (int8) where it is block-quantized."""
        _, stored, dtype, (begin, end) = self.entries[key]
        count = (end - begin) // dtype.itemsize
        if count == 0:
            return torch.empty(stored, dtype=dtype)
        return torch.frombuffer(self.mapping, dtype=dtype, count=count, offset=begin).view(stored)
