"""A Q4_K quantizer: rows of float weights into llama.cpp's Q4_K blocks (the gguf package has none for K-quants).

A Q4_K super-block holds 256 values in 144 bytes: fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales and
eight 6-bit mins packed together, and 128 bytes of 4-bit quants, two sub-blocks of 32 per 32 bytes (the first
in the low nibbles). A value is ``d * scale * q - dmin * min``. The fit is a simple one: each sub-block of 32
first spans its own minimum (never above 0, as llama.cpp's) to its maximum in 15 steps, then takes two
least-squares steps (the step and minimum that best fit its values to its quants, kept where they lower the
sub-block's error); the eight steps and the eight minima are quantized to 6 bits against the super-block's
largest ones; the quants are then rounded against those quantized scales. llama.cpp's reference searches a
range of candidate scales per sub-block instead, so its files can be slightly more accurate at the same size.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BLOCK_BYTES", "BLOCK_VALUES", "fitted_steps_and_mins", "quantize_q4_k", "quantize_super_blocks",
           "scales_and_mins"]

BLOCK_VALUES = 256  # QK_K
BLOCK_BYTES = 144
_SUB = 32
_ROWS_PER_STEP_VALUES = 1 << 22  # values quantized at once: bounds the temporaries of a large layer


def quantize_q4_k(weights: torch.Tensor | np.ndarray) -> np.ndarray:
    """``weights`` ([..., n], n a multiple of 256) as Q4_K bytes: uint8 of shape [..., n // 256 * 144]."""
    return quantize_super_blocks(weights, "Q4_K", BLOCK_BYTES, _blocks)


def quantize_super_blocks(weights: torch.Tensor | np.ndarray, name: str, block_bytes: int, blocks) -> np.ndarray:
    """``weights`` ([..., n], n a multiple of 256) as ``blocks`` ([count, 256] float32 -> [count, block_bytes]
    uint8) writes them, a bounded number of super-blocks at a time: uint8 of shape [..., n // 256 * block_bytes]."""
    values = torch.as_tensor(weights).to(torch.float32)
    *outer, width = values.shape
    if width % BLOCK_VALUES:
        raise ValueError(f"{name} needs rows of whole 256-value blocks; these have {width} values")
    flat = values.reshape(-1, BLOCK_VALUES)
    out = np.empty((flat.shape[0], block_bytes), dtype=np.uint8)
    step = max(1, _ROWS_PER_STEP_VALUES // BLOCK_VALUES)
    for begin in range(0, flat.shape[0], step):
        out[begin:begin + step] = blocks(flat[begin:begin + step]).numpy()
    return out.reshape(*outer, width // BLOCK_VALUES * block_bytes)


def fitted_steps_and_mins(sub: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, top: int, steps: int = 2
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's (step, minimum) after ``steps`` least-squares fits of its values to its quants (0..``top``),
    from the given ones; a fit is kept only where it lowers the sub-block's error. Q4_K's, Q5_K's and Q2_K's."""

    def fit(scales, mins):
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
        quants = torch.round((sub + mins.unsqueeze(-1)) / safe).clamp(0, top)
        error = (quants * scales.unsqueeze(-1) - mins.unsqueeze(-1) - sub).square().sum(dim=-1)
        return quants, error

    quants, error = fit(scales, mins)
    for _ in range(steps):
        centred = quants - quants.mean(dim=-1, keepdim=True)
        variance = centred.square().sum(dim=-1)
        new_scales = (centred * sub).sum(dim=-1) / torch.where(variance > 0, variance, torch.ones_like(variance))
        new_mins = (new_scales * quants.mean(dim=-1) - sub.mean(dim=-1)).clamp(min=0.0)
        usable = (variance > 0) & (new_scales > 0)
        new_quants, new_error = fit(torch.where(usable, new_scales, scales), torch.where(usable, new_mins, mins))
        better = usable & (new_error < error)
        scales, mins = torch.where(better, new_scales, scales), torch.where(better, new_mins, mins)
        quants = torch.where(better.unsqueeze(-1), new_quants, quants)
        error = torch.where(better, new_error, error)
    return scales, mins


def scales_and_mins(sub: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """Q4_K's and Q5_K's shared part, of [n, 8, 32] sub-blocks whose quants run 0..``top``: (fp16 ``d`` and ``dmin``
    as [n, 2] uint8 each, the 12 bytes of packed 6-bit scales and mins [n, 12], the quants [n, 8, 32] uint8)."""
    count = sub.shape[0]
    low = sub.amin(dim=-1).clamp(max=0.0)  # the sub-block's minimum, never above 0
    high = sub.amax(dim=-1)
    scales, mins = fitted_steps_and_mins(sub, (high - low) / top, -low, top)
    max_scale = scales.amax(dim=-1, keepdim=True)
    max_min = mins.amax(dim=-1, keepdim=True)
    d = (max_scale / 63.0).to(torch.float16)
    dmin = (max_min / 63.0).to(torch.float16)
    # The 6-bit scales and mins, as llama.cpp's reference: against the largest one, not the fp16-rounded d.
    inverse_scale = torch.where(max_scale > 0, 63.0 / max_scale, torch.zeros_like(max_scale))
    inverse_min = torch.where(max_min > 0, 63.0 / max_min, torch.zeros_like(max_min))
    quantized_scales = torch.round(scales * inverse_scale).clamp(0, 63).to(torch.uint8)
    quantized_mins = torch.round(mins * inverse_min).clamp(0, 63).to(torch.uint8)
    # The quants against the scales as they will be read back.
    step = (d.to(torch.float32) * quantized_scales.to(torch.float32)).unsqueeze(-1)
    offset = (dmin.to(torch.float32) * quantized_mins.to(torch.float32)).unsqueeze(-1)
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    quants = torch.where(step > 0, torch.round((sub + offset) / safe_step), torch.zeros_like(sub))
    quants = quants.clamp(0, top).to(torch.uint8)  # [n, 8, 32]

    packed_scales = torch.empty(count, 12, dtype=torch.uint8)
    low_scales, high_scales = quantized_scales[:, :4], quantized_scales[:, 4:]
    low_mins, high_mins = quantized_mins[:, :4], quantized_mins[:, 4:]
    packed_scales[:, 0:4] = (low_scales & 0x3F) | ((high_scales >> 4) << 6)
    packed_scales[:, 4:8] = (low_mins & 0x3F) | ((high_mins >> 4) << 6)
    packed_scales[:, 8:12] = (high_scales & 0x0F) | ((high_mins & 0x0F) << 4)
    return d.view(torch.uint8), dmin.view(torch.uint8), packed_scales, quants


def _blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 144] uint8."""
    count = blocks.shape[0]
    d, dmin, packed_scales, quants = scales_and_mins(blocks.reshape(count, 8, _SUB), 15)
    pairs = quants.reshape(count, 4, 2, _SUB)  # sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
    packed_quants = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(count, 128)
    return torch.cat([d, dmin, packed_scales, packed_quants], dim=1)
