"""The banded VAE decode with each band computed by a compiled model: a compiled decode in bounded memory.

Why: a VAE decode compiled whole (OpenVINO) allocates buffers for every full-resolution tensor of the
graph at once (SD 1.5 fp32 512x512: 0.75 GiB kept between calls, 1.1 GiB at the first call), which a
Session pays beside the compiled UNet it keeps. The eager banded decode (memfit.run.banded_decode) holds a
layer's input and output only, but runs every conv in PyTorch.

How: the same structure as memfit.run.banded_decode (GroupNorm statistics gathered over the whole tensor
first, then each "GroupNorm -> SiLU -> 3x3 conv" and each "nearest 2x -> 3x3 conv" of the decoder's up path
evaluated band by band of output rows), with each band handed to a kernel of fixed shape installed on the
conv itself as ``conv.band``: one band of input rows with its one-row halo above and below, the channel
scale and shift of the exact statistics, and a row mask that zeroes the rows outside the image (the conv's
zero padding, which applies after the activation). Every band of a layer has the same shapes (the band
height divides the layer's height), so each conv compiles once per image size. ``compile_band_kernels``
compiles them (memfit.compile.entry_points.compile_blocks with ``method="band"``: each kernel is a model of
its own, stored in memfit's store, its torch weights memory-mapped, its intermediate buffers freed after each
call); the mid block (at latent resolution) is compiled whole the same way. Left uncompiled, the kernels run
in PyTorch and compute the same thing.

Exactness: the statistics are memfit.run.banded_decode's (torch's own kernel on whole channel groups); a band
computes the same sums per output element as the whole conv. Compiled, the kernels round as the backend does
(OpenVINO fp32: within its tolerance, 1e-4, of the decode compiled whole; tests/test_compiled_banded_decode.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from memfit.quant.layers import layer_weight
from memfit.run.banded_decode import (DEFAULT_BAND_BYTES, band_heap, channel_affine, group_stats, rows_per_band,
                                      unsupported_reason, walk_decoder)

__all__ = ["band_kernel_paths", "compile_band_kernels", "enable_compiled_banded_decode", "is_compiled_banded"]

_MARK = "_memfit_compiled_banded"
KERNEL = "band"  # the attribute each banded conv carries its kernel under (compiled over it)
MID_BLOCK = "decoder.mid_block"


def enable_compiled_banded_decode(vae, band_bytes: int = DEFAULT_BAND_BYTES) -> None:
    """Make ``vae.decode`` run in bands through per-conv kernels (PyTorch until compile_band_kernels)."""
    from memfit.errors import MemfitError

    reason = unsupported_reason(vae)
    if reason:
        raise MemfitError(f"Cannot bound the VAE decode's activations: {reason}.")
    decoder = vae.decoder
    if _MARK in vars(decoder):
        return
    for up_block in decoder.up_blocks:
        for resnet in up_block.resnets:
            vars(resnet.conv1)[KERNEL] = functools.partial(_norm_act_conv_kernel, resnet.conv1, None, 1.0)
            vars(resnet.conv2)[KERNEL] = functools.partial(_norm_act_conv_kernel, resnet.conv2, resnet.conv_shortcut,
                                                           resnet.output_scale_factor)
        for upsampler in up_block.upsamplers or ():
            conv = _upsampler_conv(upsampler)
            vars(conv)[KERNEL] = functools.partial(_upsample_conv_kernel, conv)
    vars(decoder.conv_out)[KERNEL] = functools.partial(_norm_act_conv_kernel, decoder.conv_out, None, 1.0)
    vars(decoder)[_MARK] = True
    decoder.forward = functools.partial(_decoder_forward, decoder, band_bytes)


def is_compiled_banded(vae) -> bool:
    decoder = getattr(vae, "decoder", None)
    return decoder is not None and _MARK in vars(decoder)


def band_kernel_paths(vae) -> list[str]:
    """The module paths (in ``vae``) of the convs that carry a band kernel."""
    paths = {id(module): path for path, module in vae.named_modules()}
    return [paths[id(module)] for module in vae.modules() if KERNEL in vars(module)]


def compile_band_kernels(vae, component: str, backend, *, fallback=None, cache=None, fingerprint: str | None = None,
                         source=None, run_dtype: torch.dtype | None = None) -> list:
    """Compile every band kernel of ``vae`` (each a model of its own) and its mid block; their CompileRecords."""
    from memfit.compile.entry_points import compile_blocks

    kwargs = dict(fallback=fallback, cache=cache, fingerprint=fingerprint, source=source, run_dtype=run_dtype)
    return [*compile_blocks(vae, component, [MID_BLOCK], backend, **kwargs),
            *compile_blocks(vae, component, band_kernel_paths(vae), backend, method=KERNEL, **kwargs)]


def _upsampler_conv(upsampler):
    return upsampler.conv if upsampler.name == "conv" else upsampler.Conv2d_0


# --- kernels: one band, fixed shapes --------------------------------------------------------------


def _norm_act_conv_kernel(conv, shortcut, output_scale, x, scale, shift, mask, residual=None):
    """conv(silu(x * scale + shift) * mask) without row padding: ``x`` is the band with one halo row above and
    below (R + 2 rows in, R out); ``mask`` (1, 1, R + 2, 1) zeroes the halo rows outside the image. With
    ``residual`` (the band's R rows of the block input): (shortcut(residual) + that) / output_scale."""
    activated = F.silu(torch.addcmul(shift, x if x.dtype == torch.float32 else x.float(), scale)).to(x.dtype) * mask
    y = F.conv2d(activated, layer_weight(conv, activated.dtype), conv.bias, padding=(0, 1))
    if residual is not None:
        skip = residual if shortcut is None else F.conv2d(residual, layer_weight(shortcut, residual.dtype),
                                                          shortcut.bias)
        y = skip + y
        if output_scale != 1.0:
            y = y / output_scale
    return y


def _upsample_conv_kernel(conv, x):
    """conv(nearest_2x(x)) for R output rows: ``x`` holds the R / 2 source rows with one more above and below
    (zeros outside the image, which upsample to the conv's zero padding)."""
    upsampled = F.interpolate(x, scale_factor=2.0, mode="nearest")
    rows = upsampled.shape[2] - 4
    return F.conv2d(upsampled[:, :, 1:rows + 3], layer_weight(conv, upsampled.dtype), conv.bias, padding=(0, 1))


# --- the decode: bands of fixed height ------------------------------------------------------------


def _band_rows(height: int, at_most: int, step: int = 1) -> int:
    """The largest multiple of ``step`` dividing ``height`` that is at most ``at_most`` (at least ``step``)."""
    best = step
    for rows in range(step, min(height, max(at_most, step)) + 1, step):
        if height % rows == 0:
            best = rows
    return best if height % best == 0 else height


def _decoder_forward(decoder, band_bytes, sample, latent_embeds=None):
    # memfit.run.banded_decode's walk (layer by layer, each input dropped as soon as it is used), each layer's
    # bands through the kernels on its convs. No memfit hooks are fired around them: a compiled VAE's torch
    # weights stay as loaded (memory-mapped), left out when memfit.run.fit carries out the plan.
    return walk_decoder(decoder, sample, latent_embeds,
                        resnet_forward=functools.partial(_resnet_bands, band_bytes=band_bytes),
                        upsampler_forward=lambda upsampler, sample: _upsample_conv(sample, _upsampler_conv(upsampler),
                                                                                   band_bytes),
                        output_forward=lambda sample: _norm_act_conv(sample, decoder.conv_norm_out,
                                                                     decoder.conv_out, band_bytes),
                        layers_ready=lambda *modules: contextlib.nullcontext())


def _resnet_bands(resnet, sample, *, band_bytes: int):
    """A ResnetBlock2D in bands: its second conv adds the block input (its kernel the shortcut and output scale)
    and writes over the first conv's output."""
    hidden = _norm_act_conv(sample, resnet.norm1, resnet.conv1, band_bytes)
    return _norm_act_conv(hidden, resnet.norm2, resnet.conv2, band_bytes, residual=sample, overwrite=True)


def _norm_act_conv(x, norm, conv, band_bytes: int, *, residual=None, overwrite: bool = False):
    n, channels, height, width = x.shape
    channels_out = conv.out_channels
    overwrite = overwrite and channels_out == channels
    scale, shift = channel_affine(norm, *group_stats(x, norm, band_bytes), channels)
    out = x if overwrite else x.new_empty((n, channels_out, height, width))
    rows = _band_rows(height, rows_per_band(channels, channels_out, width, x.element_size(), band_bytes))
    with band_heap(band_bytes):  # the bands' temporaries handed back to the OS after the layer, as in the eager one
        _norm_act_conv_bands(x, out, conv, scale, shift, rows, residual, overwrite)
    return out


def _norm_act_conv_bands(x, out, conv, scale, shift, rows, residual, overwrite) -> None:
    n, channels, height, width = x.shape
    band = x.new_zeros((n, channels, rows + 2, width))
    above = None  # with overwrite: the input row above the band, saved before the band before wrote over it
    for r0 in range(0, height, rows):
        r1 = r0 + rows
        band[:, :, 1:rows + 1] = x[:, :, r0:r1]
        if r0 > 0:
            band[:, :, 0] = above[:, :, 0] if overwrite else x[:, :, r0 - 1]
        band[:, :, rows + 1] = x[:, :, r1] if r1 < height else 0
        mask = torch.ones((1, 1, rows + 2, 1), dtype=x.dtype)
        if r0 == 0:
            mask[:, :, 0] = 0
        if r1 == height:
            mask[:, :, -1] = 0
        kernel_args = (band, scale, shift, mask) if residual is None else (band, scale, shift, mask,
                                                                          residual[:, :, r0:r1].contiguous())
        y = getattr(conv, KERNEL)(*kernel_args)
        if overwrite:
            above = x[:, :, r1 - 1:r1].clone()
        out[:, :, r0:r1] = y


def _upsample_conv(x, conv, band_bytes: int):
    n, channels, height, width = x.shape
    out_height, out_width = 2 * height, 2 * width
    out = x.new_empty((n, conv.out_channels, out_height, out_width))
    rows = _band_rows(out_height, rows_per_band(channels, conv.out_channels, out_width, x.element_size(), band_bytes),
                      step=2)
    half = rows // 2
    source = x.new_zeros((n, channels, half + 2, width))
    with band_heap(band_bytes):
        for r0 in range(0, out_height, rows):
            s0 = r0 // 2 - 1  # source row of the band's first source row (one above its own rows)
            lo, hi = max(s0, 0), min(s0 + half + 2, height)
            source.zero_()
            source[:, :, lo - s0:hi - s0] = x[:, :, lo:hi]
            out[:, :, r0:r0 + rows] = getattr(conv, KERNEL)(source)
    return out
