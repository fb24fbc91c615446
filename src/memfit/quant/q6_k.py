"""A Q6_K quantizer: rows of float weights into llama.cpp's Q6_K blocks (the gguf package has none for K-quants).

A Q6_K super-block holds 256 values in 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen
int8 scales (one a sub-block of 16 values) and an fp16 ``d`` last. A value is ``d * scale * (q - 32)``, q in
0..63. The quants are packed in two halves of 128 values: in a half, value ``l`` (0..31) of its four quarters
a, b, c, d puts a's and c's low bits in low byte ``l`` (a in the low nibble), b's and d's in low byte ``32 + l``,
and the four high 2-bit pairs in high byte ``l`` (a in the lowest two bits). Each sub-block's scale first maps
its largest magnitude to -32 (as llama.cpp's reference, whose scale search this leaves out), then takes two
least-squares steps; the sixteen scales are quantized to int8 against the largest, which maps to -128.
"""

from __future__ import annotations

import numpy as np
import torch

from memfit.quant.q4_k import quantize_super_blocks

__all__ = ["BLOCK_BYTES", "quantize_q6_k", "signed_extreme", "symmetric_scales"]

BLOCK_BYTES = 210
_SUB = 16


def quantize_q6_k(weights: torch.Tensor | np.ndarray) -> np.ndarray:
    """``weights`` ([..., n], n a multiple of 256) as Q6_K bytes: uint8 of shape [..., n // 256 * 210]."""
    return quantize_super_blocks(weights, "Q6_K", BLOCK_BYTES, _blocks)


def signed_extreme(values: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude along the last dimension, with its sign."""
    return values.gather(-1, values.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)


def symmetric_scales(sub: torch.Tensor, lowest: int, steps: int = 2) -> torch.Tensor:
    """Each sub-block's scale for quants ``lowest``..``-lowest - 1`` (Q6_K's -32..31, Q3_K's -4..3): its largest
    magnitude mapped to ``lowest``, then least-squares steps where they lower its error."""

    def fit(scales):
        safe = torch.where(scales != 0, scales, torch.ones_like(scales)).unsqueeze(-1)
        quants = torch.round(sub / safe).clamp(lowest, -lowest - 1)
        return quants, (quants * scales.unsqueeze(-1) - sub).square().sum(dim=-1)

    scales = signed_extreme(sub) / float(lowest)
    quants, error = fit(scales)
    for _ in range(steps):
        energy = quants.square().sum(dim=-1)
        fitted = (quants * sub).sum(dim=-1) / torch.where(energy > 0, energy, torch.ones_like(energy))
        usable = (energy > 0) & (fitted != 0)
        new_quants, new_error = fit(torch.where(usable, fitted, scales))
        better = usable & (new_error < error)
        scales = torch.where(better, fitted, scales)
        quants = torch.where(better.unsqueeze(-1), new_quants, quants)
        error = torch.where(better, new_error, error)
    return scales


def _blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 210] uint8."""
    count = blocks.shape[0]
    sub = blocks.reshape(count, 16, _SUB)
    scales = symmetric_scales(sub, -32)
    largest = signed_extreme(scales).unsqueeze(-1)  # [n, 1]
    inverse = torch.where(largest != 0, -128.0 / largest, torch.zeros_like(largest))
    d = torch.where(largest != 0, 1.0 / inverse, torch.zeros_like(largest)).to(torch.float16)
    quantized_scales = torch.round(inverse * scales).clamp(-128, 127)
    # The quants against the scales as they will be read back; a sub-block whose scale is 0 reads 0 whatever its
    # quants, which are then 32 (0 once centred) or, for a super-block of zeros (d = 0), all bytes 0 as llama.cpp's.
    step = (d.to(torch.float32) * quantized_scales).unsqueeze(-1)
    safe_step = torch.where(step != 0, step, torch.ones_like(step))
    quants = torch.where(step != 0, torch.round(sub / safe_step).clamp(-32, 31) + 32, torch.full_like(sub, 32.0))
    quants = torch.where((d == 0).view(count, 1, 1), torch.zeros_like(quants), quants).to(torch.uint8)

    halves = quants.reshape(count, 2, 4, 32)  # [n, half, quarter, l]
    low, high = halves & 0x0F, halves >> 4
    packed_low = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)
    packed_high = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return torch.cat([packed_low.reshape(count, 128), packed_high.reshape(count, 64),
                      quantized_scales.to(torch.int8).view(torch.uint8), d.view(torch.uint8)], dim=1)
