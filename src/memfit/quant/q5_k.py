"""A Q5_K quantizer: rows of float weights into llama.cpp's Q5_K blocks (the gguf package has none for K-quants).

A Q5_K super-block holds 256 values in 176 bytes: fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales and
eight 6-bit mins packed as Q4_K's, 32 bytes of high bits and 128 bytes of low 4 bits. Of the quants' five bits,
the low four are packed as Q4_K's quants (sub-blocks 2j and 2j + 1 share 32 bytes, 2j in the low nibbles); the
fifth bit of value ``l`` of sub-block ``s`` is bit ``s`` of high byte ``l``. A value is
``d * scale * q - dmin * min``, q in 0..31; the fit is memfit.quant.q4_k's with 31 steps a sub-block.
"""

from __future__ import annotations

import numpy as np
import torch

from memfit.quant.q4_k import quantize_super_blocks, scales_and_mins

__all__ = ["BLOCK_BYTES", "quantize_q5_k"]

BLOCK_BYTES = 176
_SUB = 32


def quantize_q5_k(weights: torch.Tensor | np.ndarray) -> np.ndarray:
    """``weights`` ([..., n], n a multiple of 256) as Q5_K bytes: uint8 of shape [..., n // 256 * 176]."""
    return quantize_super_blocks(weights, "Q5_K", BLOCK_BYTES, _blocks)


def _blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 176] uint8."""
    count = blocks.shape[0]
    d, dmin, packed_scales, quants = scales_and_mins(blocks.reshape(count, 8, _SUB), 31)
    low = quants & 0x0F
    pairs = low.reshape(count, 4, 2, _SUB)
    packed_low = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(count, 128)
    high = (quants >> 4).to(torch.int32)  # [n, 8, 32], 0 or 1
    bits = torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    packed_high = (high << bits).sum(dim=1).to(torch.uint8)  # [n, 32]: bit s of byte l is sub-block s's value l
    return torch.cat([d, dmin, packed_scales, packed_high, packed_low], dim=1)
