"""The stored formats memfit reads: GGUF's block types, fp8 and int8, each a way to turn stored bytes into values.

A format knows its block: ``block_size`` values stored in ``type_size`` bytes along a tensor's last
dimension (fp8: one value in one byte), so a tensor's stored shape is its logical shape with the last
dimension in bytes. int8 (what ``--quantize NAME=int8`` writes) is one value per byte with one float32
scale per output row, kept beside the bytes (StoredTensor.scale of shape [rows]). The GGUF arithmetic is
diffusers' own (diffusers.quantizers.gguf.utils, the functions its GGUF loading runs), so a weight
dequantizes to the same values as there, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from memfit.errors import MemfitError

__all__ = ["FP8_FORMATS", "INT8_FORMAT", "INT8_SCALE_SUFFIX", "STORAGE_DTYPE", "StoredFormat", "StoredTensor",
           "dequantized_elements", "gguf_format", "int8_row_scale", "is_stored", "mark_stored", "readable_gguf_types"]

_STORED_ATTR = "_memfit_stored_format"
#: The dtype stored bytes are held in. int8, not uint8: it is the dtype of quantized weights the libraries
#: expect (transformers' T5 casts its activations to its output projection's weight dtype unless it is int8).
STORAGE_DTYPE = torch.int8


@dataclass(frozen=True)
class StoredFormat:
    """How a weight's bytes hold its values: ``name`` as users know it ("Q4_K", "fp8_e4m3fn")."""

    name: str
    block_size: int  # values per block, along the last dimension
    type_size: int  # bytes per block
    _dequantize: Callable[[torch.Tensor], torch.Tensor]  # (blocks, type_size bytes each) -> values

    def stored_shape(self, shape) -> tuple[int, ...]:
        """The bytes' shape of a tensor of logical ``shape``."""
        *outer, last = shape
        return (*outer, last // self.block_size * self.type_size)

    def logical_shape(self, stored_shape) -> tuple[int, ...]:
        *outer, last = stored_shape
        return (*outer, last // self.type_size * self.block_size)

    def fits(self, shape) -> bool:
        """Whether a tensor of logical ``shape`` is whole blocks along its last dimension."""
        return len(shape) > 0 and shape[-1] % self.block_size == 0

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values of ``stored`` (its bytes, STORAGE_DTYPE, in the stored shape) in ``dtype``."""
        blocks = stored.view(torch.uint8).reshape(-1, self.type_size)
        return self._dequantize(blocks).reshape(self.logical_shape(stored.shape)).to(dtype)


class StoredTensor(NamedTuple):
    """One tensor stored smaller than it runs: its format, its logical shape, and the scale its values are
    multiplied by where the file has one: one per tensor (Comfy's "scaled" fp8: ``scale_weight`` beside the
    weight, a 0-d tensor) or one per output row (int8's ``weight_scale``, float32 of shape [rows])."""

    format: StoredFormat
    shape: tuple[int, ...]
    scale: torch.Tensor | None = None

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.scale is not None and self.scale.ndim == 1:
            return _scale_rows(self.format, stored, self.scale, dtype)
        values = self.format.dequantize(stored, dtype)
        # As ComfyUI applies it: the weight in the compute dtype times the scale in the compute dtype.
        return values if self.scale is None else values * self.scale.to(device=values.device, dtype=dtype)


#: Rows dequantized per step of a per-row scaled weight: the float32 product lives for one step only, so the
#: scratch a layer takes stays its weight in the compute dtype (what the planner counts), plus this much.
_SCALED_STEP_ELEMENTS = 1 << 20


def _scale_rows(fmt: StoredFormat, stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's values times its scale, the product in float32 and rounded once into ``dtype``."""
    rows = stored.shape[0]
    out = torch.empty(fmt.logical_shape(stored.shape), dtype=dtype, device=stored.device)
    scale = scale.to(device=stored.device, dtype=torch.float32)
    step = max(1, _SCALED_STEP_ELEMENTS // max(1, out[0].numel()))
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        values = fmt.dequantize(stored[begin:end], torch.float32)
        out[begin:end] = values * scale[begin:end].reshape(-1, *(1,) * (values.ndim - 1))
    return out


def _fp8(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    # fp8 to any wider float is exact: the same values as converting the weight when it is loaded.
    return lambda blocks: blocks.view(dtype)


FP8_FORMATS = {dtype: StoredFormat(str(dtype).removeprefix("torch.").replace("float8", "fp8"), 1, 1, _fp8(dtype))
               for dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if dtype}


#: ``--quantize NAME=int8``: one signed byte per value (its weight_scale, one per row, beside it).
INT8_FORMAT = StoredFormat("int8", 1, 1, lambda blocks: blocks.view(torch.int8))
#: An int8 weight ``X.weight``'s per-row scales are ``X.weight_scale`` (the name Comfy's scaled files use).
INT8_SCALE_SUFFIX = "_scale"


def int8_row_scale(file, key: str, shapes: dict) -> torch.Tensor | None:
    """The per-row scales (float32, [rows]) of int8 weight ``key`` of a safetensors ``file`` (``shapes``: its
    key -> (dtype, shape)) when the file has them as ``key + INT8_SCALE_SUFFIX`` (what memfit's int8 writer
    stores), else None: an int8 tensor without them is an ordinary int8 tensor."""
    scale_key = key + INT8_SCALE_SUFFIX
    shape = shapes[key][1]
    if not key.endswith(".weight") or len(shape) != 2 or scale_key not in shapes:
        return None
    scale_dtype, scale_shape = shapes[scale_key]
    if not scale_dtype.is_floating_point or list(scale_shape) != [shape[0]]:
        raise MemfitError(f"{file.path} scales int8 weight {key} by {scale_key} of shape {list(scale_shape)} "
                          f"({scale_dtype}): memfit reads one float scale per row, shape [{shape[0]}]; quantize the "
                          "component again (--quantize NAME=int8) or use a file in bf16.")
    return file.tensor(scale_key).to(torch.float32)


def readable_gguf_types() -> dict[int, StoredFormat]:
    """GGUF type number -> format, for every block type memfit dequantizes (F32, F16 and BF16 are plain dtypes)."""
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, dequantize_functions

    formats = {}
    for quant_type, function in dequantize_functions.items():
        if quant_type.name == "BF16":
            continue  # a plain dtype, read as torch.bfloat16 (the same values diffusers' function gives)
        block_size, type_size = GGML_QUANT_SIZES[quant_type]
        formats[int(quant_type)] = StoredFormat(
            quant_type.name, block_size, type_size,
            lambda blocks, f=function, b=block_size, t=type_size: f(blocks, b, t))
    return formats


def gguf_format(quant_type: int, where: str) -> StoredFormat:
    """The format of GGUF type ``quant_type``; one sentence naming the ones memfit reads when it is not one."""
    formats = readable_gguf_types()
    if quant_type not in formats:
        import gguf

        try:
            name = gguf.GGMLQuantizationType(quant_type).name
        except ValueError:
            name = f"type {quant_type}"
        readable = ", ".join(["F32", "F16", "BF16", *sorted((f.name for f in formats.values()),
                                                            key=lambda name: (name.startswith("IQ"), name))])
        raise MemfitError(f"{where} is stored as GGUF {name}, which memfit does not read; it reads {readable}. "
                          "Use a file quantized to one of them.")
    return formats[quant_type]


def mark_stored(parameter: torch.Tensor, fmt: StoredFormat) -> None:
    """Mark ``parameter`` (a module's tensor object, which keeps its identity while its data moves) as stored."""
    setattr(parameter, _STORED_ATTR, fmt)


def is_stored(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds a weight's stored bytes, which keep their dtype in every tier."""
    return getattr(tensor, _STORED_ATTR, None) is not None


def dequantized_elements(tensor: torch.Tensor) -> int:
    """How many values dequantizing ``tensor`` makes (0 for a tensor that is not stored): at the compute dtype's
    size, the scratch its layer's forward holds beside it."""
    fmt = getattr(tensor, _STORED_ATTR, None)
    if fmt is None:
        return 0
    return math.prod(fmt.logical_shape(tensor.shape))
