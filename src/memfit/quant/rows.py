"""A layout's key conversion carried over stored (block-quantized) tensors.

Conversions read logical shapes (a fused projection is split at the width the file has, a family is
told by a tensor's columns) and move whole rows: a rename, a row slice of a fused ``qkv``, the halves
of a modulation swapped. A block format keeps every row's bytes apart (blocks run along the last
dimension), so a row of values is a row of bytes. Each stored tensor is given to the conversion as
a stand-in of its logical shape whose every element names its (tensor, row); what comes out names
the rows each converted tensor is made of, and those rows of bytes are that tensor: a view of the
file where they are consecutive rows of one tensor, a copy of them otherwise. A conversion that does
anything else to a stored tensor (a transpose) is refused, naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.errors import MemfitError
from memfit.quant.formats import StoredTensor

__all__ = ["convert_stored"]

_ROW_BITS = 40  # stand-in value: (tensor number + 1) << _ROW_BITS | row


def convert_stored(convert: Callable[[dict], dict], tensors: dict[str, torch.Tensor], stored: dict[str, StoredTensor],
                   where: str) -> tuple[dict[str, torch.Tensor], dict[str, StoredTensor]]:
    """``convert(tensors)`` where the tensors ``stored`` names (key -> StoredTensor) are their bytes. Returns
    (converted tensors, stored bytes for the stored ones; {converted name: StoredTensor})."""
    keys = list(stored)
    stand_ins = {}
    for number, key in enumerate(keys):
        shape = stored[key].shape
        ids = torch.arange(shape[0], dtype=torch.int64) + ((number + 1) << _ROW_BITS)
        stand_ins[key] = ids.as_strided(shape, (1,) + (0,) * (len(shape) - 1))
    storages = {stand_in.untyped_storage().data_ptr(): key for key, stand_in in stand_ins.items()}
    converted = convert({**tensors, **stand_ins})
    out, formats = {}, {}
    for name, value in converted.items():
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.ndim == 0 or (
                value.untyped_storage().data_ptr() not in storages and not _is_stand_in(value, len(keys))):
            out[name] = value
            continue
        if any(stride != 0 for stride in value.stride()[1:]) and value.untyped_storage().data_ptr() in storages:
            raise MemfitError(f"{where}: converting it to diffusers' names rearranges the stored tensor behind "
                              f"{name!r} other than by rows, which memfit cannot do to a quantized tensor; use a "
                              "file of this component in diffusers' layout or unquantized.")
        ids = value.reshape(value.shape[0], -1)[:, 0] if value.ndim > 1 else value
        if value.ndim > 1 and not torch.equal(value.reshape(value.shape[0], -1), ids[:, None].expand(-1, value[0].numel())):
            raise MemfitError(f"{where}: converting it to diffusers' names mixes the rows behind {name!r}, which "
                              "memfit cannot do to a quantized tensor; use a file of this component unquantized.")
        numbers = (ids >> _ROW_BITS) - 1
        rows = ids & ((1 << _ROW_BITS) - 1)
        sources = [keys[n] for n in numbers.unique().tolist()]
        first = stored[sources[0]]
        per_row = first.scale is not None and first.scale.ndim == 1
        if any(stored[key].format != first.format or stored[key].shape[1:] != tuple(value.shape[1:])
               or (stored[key].scale is not None) != (first.scale is not None) for key in sources) or (
                first.scale is not None and not per_row and len(sources) > 1):
            raise MemfitError(f"{where}: {name!r} is made of tensors stored in different formats, widths or scales "
                              f"({', '.join(sources)}), which memfit cannot join; use a file quantized alike.")
        out[name] = _rows(tensors, sources, numbers, rows, keys)
        # A per-row scale (int8's) goes with its row.
        scale = _rows({key: stored[key].scale for key in sources}, sources, numbers, rows, keys) if per_row \
            else first.scale
        formats[name] = first._replace(shape=tuple(value.shape), scale=scale)
    return out, formats


def _is_stand_in(value: torch.Tensor, count: int) -> bool:
    """Whether ``value`` (int64) was computed from stand-ins: every element names a stand-in's row."""
    numbers = value >> _ROW_BITS
    return bool(value.numel()) and bool(((numbers >= 1) & (numbers <= count)).all())


def _rows(tensors: dict[str, torch.Tensor], sources: list[str], numbers: torch.Tensor, rows: torch.Tensor,
          keys: list[str]) -> torch.Tensor:
    """The bytes of the given rows: a view of one stored tensor's consecutive rows, else a copy."""
    if len(sources) == 1:
        data = tensors[sources[0]]
        first, count = int(rows[0]), rows.numel()
        if torch.equal(rows, torch.arange(first, first + count)):
            return data[first:first + count]
        return data.index_select(0, rows)
    return torch.cat([tensors[keys[int(n)]][int(r)].unsqueeze(0) for n, r in zip(numbers, rows)])
