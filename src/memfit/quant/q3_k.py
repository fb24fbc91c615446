"""A Q3_K quantizer: rows of float weights into llama.cpp's Q3_K blocks (the gguf package has none for K-quants).

A Q3_K super-block holds 256 values in 110 bytes: 32 bytes of high bits, 64 bytes of low 2 bits, 12 bytes of
sixteen 6-bit scales (a sub-block of 16 values each) and an fp16 ``d`` last. A value is ``d * (scale - 32) * q``,
q in -4..3, stored as ``q + 4``: its low two bits packed as Q2_K's quants (memfit.quant.q2_k), its third bit
(set for q >= 0) bit ``i // 32`` of high byte ``i % 32`` for value ``i``. Scale ``s``'s low four bits are the low
nibble of byte ``s`` (s < 8) or the high nibble of byte ``s - 8``, its top two bits bits ``2 * (s // 4)`` of byte
``8 + s % 4``. Each sub-block's scale first maps its largest magnitude to -4 (as llama.cpp's reference, whose
weighted search this leaves out), then takes two least-squares steps (memfit.quant.q6_k's fit); the sixteen
scales are quantized to -32..31 against the largest, which maps to -32.
"""

from __future__ import annotations

import numpy as np
import torch

from memfit.quant.q2_k import pack_2_bit_quants
from memfit.quant.q4_k import quantize_super_blocks
from memfit.quant.q6_k import signed_extreme, symmetric_scales

__all__ = ["BLOCK_BYTES", "quantize_q3_k"]

BLOCK_BYTES = 110
_SUB = 16
_LOWEST = -4  # quants run -4..3
_SCALE_LOWEST = -32  # 6-bit scales run -32..31


def quantize_q3_k(weights: torch.Tensor | np.ndarray) -> np.ndarray:
    """``weights`` ([..., n], n a multiple of 256) as Q3_K bytes: uint8 of shape [..., n // 256 * 110]."""
    return quantize_super_blocks(weights, "Q3_K", BLOCK_BYTES, _blocks)


def _blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 110] uint8."""
    count = blocks.shape[0]
    sub = blocks.reshape(count, 16, _SUB)
    scales = symmetric_scales(sub, _LOWEST)
    largest = signed_extreme(scales).unsqueeze(-1)  # [n, 1]
    inverse = torch.where(largest != 0, _SCALE_LOWEST / largest, torch.zeros_like(largest))
    d = torch.where(largest != 0, 1.0 / inverse, torch.zeros_like(largest)).to(torch.float16)
    quantized_scales = torch.round(inverse * scales).clamp(_SCALE_LOWEST, -_SCALE_LOWEST - 1)
    # The quants against the scales as they will be read back; a sub-block whose scale reads 0 reads 0 whatever
    # its quants, which are then 0 (stored as 4).
    step = (d.to(torch.float32) * quantized_scales).unsqueeze(-1)
    safe_step = torch.where(step != 0, step, torch.ones_like(step))
    quants = torch.where(step != 0, torch.round(sub / safe_step).clamp(_LOWEST, -_LOWEST - 1), torch.zeros_like(sub))
    stored = (quants - _LOWEST).to(torch.int32).reshape(count, 256)  # 0..7

    high = (stored >> 2).reshape(count, 8, 32)  # [n, bit, byte]
    bits = torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    hmask = (high << bits).sum(dim=1).to(torch.uint8)  # [n, 32]

    biased = (quantized_scales - _SCALE_LOWEST).to(torch.int32)  # [n, 16], 0..63
    packed_scales = torch.empty(count, 12, dtype=torch.int32)
    packed_scales[:, :8] = (biased[:, :8] & 0x0F) | ((biased[:, 8:] & 0x0F) << 4)
    top_bits = (biased >> 4).reshape(count, 4, 4)  # [n, s // 4, s % 4]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 4, 1)
    packed_scales[:, 8:] = (top_bits << shifts).sum(dim=1)
    return torch.cat([hmask, pack_2_bit_quants(stored), packed_scales.to(torch.uint8), d.view(torch.uint8)], dim=1)
