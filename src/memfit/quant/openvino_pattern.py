"""A quantized layer's weight (a QuantizedLinear's, a QuantizedConv2d's flattened kernels) written as OpenVINO's
decompression pattern, for an OpenVINO export.

QuantizedLinear dequantizes its stored bytes in each forward with byte arithmetic (a GGUF block's bytes split,
viewed, shifted) that torch.export would trace into the graph, over weights OpenVINO would then hold in floats.
For the formats below, a layer gives instead, for the export only, its weight in the pattern OpenVINO's CPU
plugin recognises (a Constant of small integers, Convert, an optional zero point Subtract, a Multiply by the
scale, a Reshape of grouped values): its compiled model keeps the weights at their stored size and multiplies
with them directly (a FullyConnected whose weight input is int8, or u4; memfit.compile.backends.openvino_compressed):

    int8  (--quantize NAME=int8, one float32 scale per row)  int8 values [out, in] * scale [out, 1]
    Q8_0  (GGUF: fp16 d + 32 int8 per block)                 int8 values [out, in/32, 32] * d [out, in/32, 1]
    Q4_0  (GGUF: fp16 d + 16 bytes of nibbles, d * (q - 8))  (values 0..15 [out, in/32, 32] - 8) * d

The arithmetic is the stored value in float32, rounded once into the compute dtype (in bf16 for a bf16 run,
the only form the plugin fuses there: the weight then differs from the eager one by bf16 rounding). In float32, int8
is memfit's eager arithmetic (StoredTensor.dequantize) exactly; for Q8_0 and Q4_0, diffusers' dequantization
(which memfit's eager path runs) rounds each product d * q to fp16 first, so the two differ by that rounding.
Q4_0's values leave torch as uint8 (torch has no 4-bit dtype) and become u4 Constants after the conversion.

Other stored formats are not taken: fp8 converts to an f8e4m3 Constant, but the CPU plugin expands it to float32
when it compiles; Q4_1, Q5_* and the K-quants have no pattern of this kind here.

The tensors are made when asked (each call), beside the stored bytes: an int8 layer's values are its stored
bytes themselves; a Q8_0 layer's a copy of its int8 values (about its stored size), a Q4_0 layer's its nibbles
unpacked into bytes (about twice its stored size), for as long as the caller keeps them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from memfit.compile.backends.openvino_compressed import COMPRESSED_FORMATS

__all__ = ["decompression_pattern", "takes"]

_GGUF_BLOCK = 32  # values per Q8_0 / Q4_0 block
_SCALE_BYTES = 2  # the block's fp16 d, first in the block
_Q4_0_ZERO = 8


def takes(layer: Any) -> bool:
    """Whether quantized layer ``layer`` is stored in a format OpenVINO keeps compressed."""
    name, scale = layer.format.name, layer.stored.scale
    if name == "int8":
        return scale is not None and scale.ndim == 1  # memfit's int8: one scale per row
    return name in COMPRESSED_FORMATS and scale is None


def decompression_pattern(layer: Any) -> Callable[[torch.dtype], torch.Tensor] | None:
    """The weight of quantized layer ``layer`` (in its logical shape) as a function of the compute dtype, written as OpenVINO's
    decompression pattern, or None for a format OpenVINO does not keep compressed."""
    if not takes(layer):
        return None
    shape = layer.logical_shape  # a convolution's 4-D: its stored rows are the flattened kernels
    if layer.format.name == "int8":
        scale = layer.stored.scale.to(device=layer.weight.device, dtype=torch.float32).reshape(-1, 1)
        return _int8_weight(layer.weight.detach().reshape(shape[0], -1), scale, shape)
    d, rest = _blocks(layer)
    if layer.format.name == "Q8_0":
        return _grouped_weight(rest.contiguous().view(torch.int8), d, None, shape)
    # Q4_0: a block's byte j holds value j in its low nibble and value j + 16 in its high one.
    return _grouped_weight(torch.cat([rest & 0x0F, rest >> 4], dim=-1), d, _Q4_0_ZERO, shape)


def _blocks(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF layer's blocks as (their fp16 d [out, blocks, 1], their other bytes [out, blocks, n])."""
    rows = layer.logical_shape[0]
    blocks = layer.weight.detach().view(torch.uint8).reshape(rows, math.prod(layer.logical_shape) // rows // _GGUF_BLOCK, -1)
    return blocks[..., :_SCALE_BYTES].contiguous().view(torch.float16), blocks[..., _SCALE_BYTES:]


def _arithmetic_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the pattern computes in for compute dtype ``dtype``: bf16 in bf16 (the CPU plugin fuses a bf16 model's
    pattern only when it is in bf16; bf16 has float32's range), anything else in float32 (an fp16 scale could
    underflow: the plugin then decompresses the weight in each call, still from its stored values)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _int8_weight(values: torch.Tensor, scale: torch.Tensor,
                 shape: tuple[int, ...]) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        arithmetic = _arithmetic_dtype(dtype)
        return (values.to(arithmetic) * scale.to(arithmetic)).reshape(shape).to(dtype)

    return weight


def _grouped_weight(values: torch.Tensor, scale: torch.Tensor, zero_point: int | None,
                    shape: tuple[int, ...]) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        arithmetic = _arithmetic_dtype(dtype)
        decompressed = values.to(arithmetic)
        if zero_point is not None:
            decompressed = decompressed - zero_point
        return (decompressed * scale.to(arithmetic)).reshape(shape).to(dtype)

    return weight
