"""A Q2_K quantizer: rows of float weights into llama.cpp's Q2_K blocks (the gguf package has none for K-quants).

A Q2_K super-block holds 256 values in 84 bytes: 16 bytes of sub-block scales (a sub-block of 16 values each, its
4-bit scale in the low nibble and its 4-bit minimum in the high one), 64 bytes of 2-bit quants, then fp16 ``d``
and ``dmin``. A value is ``d * scale * q - dmin * min``, q in 0..3. The quants are packed in two halves of 128
values: value ``l`` (0..31) of a half's quarter ``k`` is bits ``2k, 2k + 1`` of the half's byte ``l``. The fit is
memfit.quant.q4_k's on sub-blocks of 16 with 3 steps a sub-block, the scales and minima quantized to 4 bits
against the super-block's largest ones (llama.cpp's reference searches candidate scales weighted by the values'
magnitudes instead, so its files can be slightly more accurate at the same size).
"""

from __future__ import annotations

import numpy as np
import torch

from memfit.quant.q4_k import fitted_steps_and_mins, quantize_super_blocks

__all__ = ["BLOCK_BYTES", "pack_2_bit_quants", "quantize_q2_k"]

BLOCK_BYTES = 84
_SUB = 16
_TOP = 3  # the largest 2-bit quant
_SCALE_TOP = 15  # the largest 4-bit scale or minimum


def quantize_q2_k(weights: torch.Tensor | np.ndarray) -> np.ndarray:
    """``weights`` ([..., n], n a multiple of 256) as Q2_K bytes: uint8 of shape [..., n // 256 * 84]."""
    return quantize_super_blocks(weights, "Q2_K", BLOCK_BYTES, _blocks)


def pack_2_bit_quants(quants: torch.Tensor) -> torch.Tensor:
    """[n, 256] quants of 0..3 (or their low two bits) as Q2_K's and Q3_K's 64 bytes: [n, 64] uint8."""
    quarters = (quants.to(torch.int32) & 3).reshape(quants.shape[0], 2, 4, 32)  # [n, half, quarter, l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
    return (quarters << shifts).sum(dim=2).to(torch.uint8).reshape(quants.shape[0], 64)


def _blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 84] uint8."""
    count = blocks.shape[0]
    sub = blocks.reshape(count, 16, _SUB)
    low = sub.amin(dim=-1).clamp(max=0.0)  # the sub-block's minimum, never above 0
    scales, mins = fitted_steps_and_mins(sub, (sub.amax(dim=-1) - low) / _TOP, -low, _TOP)
    max_scale = scales.amax(dim=-1, keepdim=True)
    max_min = mins.amax(dim=-1, keepdim=True)
    d = (max_scale / _SCALE_TOP).to(torch.float16)
    dmin = (max_min / _SCALE_TOP).to(torch.float16)
    inverse_scale = torch.where(max_scale > 0, _SCALE_TOP / max_scale, torch.zeros_like(max_scale))
    inverse_min = torch.where(max_min > 0, _SCALE_TOP / max_min, torch.zeros_like(max_min))
    quantized_scales = torch.round(scales * inverse_scale).clamp(0, _SCALE_TOP).to(torch.uint8)
    quantized_mins = torch.round(mins * inverse_min).clamp(0, _SCALE_TOP).to(torch.uint8)
    # The quants against the scales and minima as they will be read back.
    step = (d.to(torch.float32) * quantized_scales.to(torch.float32)).unsqueeze(-1)
    offset = (dmin.to(torch.float32) * quantized_mins.to(torch.float32)).unsqueeze(-1)
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    quants = torch.where(step > 0, torch.round((sub + offset) / safe_step), torch.zeros_like(sub)).clamp(0, _TOP)
    return torch.cat([quantized_scales | (quantized_mins << 4), pack_2_bit_quants(quants.reshape(count, 256)),
                      d.view(torch.uint8), dmin.view(torch.uint8)], dim=1)
