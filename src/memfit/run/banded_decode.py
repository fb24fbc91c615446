"""Activation-bounded VAE decode: the same decoder and the same arithmetic, run in bands of rows.

Why: a plain SD/SDXL VAE decode holds several full-resolution tensors at once. At 512x512 fp32 a
ResnetBlock2D with 256 input channels keeps its input, the GroupNorm output and the SiLU output
alive together (3 x 256 MiB), and Upsample2D keeps the 2x-interpolated tensor beside its conv
output; together about 0.9 GB of activations for a ~200 MB decoder.

How: every "GroupNorm -> SiLU -> 3x3 conv" and every "nearest 2x upsample -> 3x3 conv" of the
decoder's up path is evaluated band by band (horizontal strips of output rows), each band reading a
one-row halo of its input. GroupNorm statistics are gathered over the whole tensor before any band is
normalized, so every band is normalized with exactly the statistics the full tensor has (this is not
diffusers' tiling, which blends overlapping tiles and changes the image). The second conv of a
residual block writes its output over its own input in place (a saved copy of the one row the next
band still needs stands in for the overwritten halo). What remains at full resolution is a block's
input plus one buffer, instead of three or four. The up blocks' layers are called one by one, so an
up block's input is freed once its first resnet returns, not when the whole block does; and the
heap that a banded layer's temporaries used is handed back to the OS when the layer ends (SD 1.5
fp32 512x512: 476 MiB of activations instead of 673 MiB with both left as they were).

Exactness: every band computes the same sums per output element as the whole-tensor op, GroupNorm
is applied the way torch's CPU kernel fuses it (statistics from torch's own kernel on whole channel
groups, then x * scale + shift with the same fused multiply-adds), and nearest upsampling is a copy.
What can still differ is the convolution library's choice of kernel for a band of rows versus the
whole tensor (another summation order): results agree within float rounding (fp32: max |difference|
<= 1e-5 on images in [-1, 1], tested in tests/test_banded_decode.py). Measured on this machine, the
SD 1.5 VAE's 3x3 convs and norms are bitwise equal at real sizes; its two 1x1 shortcut convs are not
(4e-6 at 256x256).

Hooks: the overrides are instance-level ``forward`` attributes on the decoder, its resnets and its
upsamplers, so everything is still entered through ``module.__call__`` and memfit's weight-swapping
hooks (offload.py) fire as usual; sub-layers used directly (norms, convs) have theirs fired through
``offload.weights_ready``. ``disable_banded_decode`` removes every override.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch
import torch.nn.functional as F

from memfit.quant.layers import layer_weight
from memfit.run.memory import heap_for_temporaries_under
from memfit.run.offload import weights_ready

__all__ = [
    "DEFAULT_BAND_BYTES", "band_heap", "channel_affine", "disable_banded_decode", "enable_banded_decode", "group_stats", "is_banded",
    "rows_per_band", "unsupported_reason", "walk_decoder",
]

DEFAULT_BAND_BYTES = 16 * 2**20  # temporaries of one band; small against any full-resolution tensor
_MARK = "_memfit_banded"


def unsupported_reason(vae) -> str | None:
    """None when ``vae`` (an AutoencoderKL) can be decoded in bands; otherwise why not."""
    decoder = getattr(vae, "decoder", None)
    if decoder is None or not hasattr(decoder, "up_blocks") or not hasattr(decoder, "conv_norm_out"):
        return f"{type(vae).__name__} has no AutoencoderKL-style decoder"
    if not isinstance(decoder.conv_norm_out, torch.nn.GroupNorm):
        return "the decoder's output norm is not a GroupNorm (spatial norm decoders are not banded)"
    if not isinstance(decoder.conv_act, torch.nn.SiLU) or not _is_plain_conv3(decoder.conv_out):
        return "the decoder's output layers are not GroupNorm -> SiLU -> 3x3 conv"
    for index, up_block in enumerate(decoder.up_blocks):
        for resnet in getattr(up_block, "resnets", ()):
            reason = _resnet_reason(resnet)
            if reason:
                return f"up_blocks.{index}: {reason}"
        for upsampler in getattr(up_block, "upsamplers", None) or ():
            reason = _upsampler_reason(upsampler)
            if reason:
                return f"up_blocks.{index}: {reason}"
    return None


def enable_banded_decode(vae, band_bytes: int = DEFAULT_BAND_BYTES) -> None:
    """Make ``vae.decode`` run banded (see the module docstring); raises if unsupported."""
    from memfit.errors import MemfitError

    reason = unsupported_reason(vae)
    if reason:
        raise MemfitError(f"Cannot bound the VAE decode's activations: {reason}.")
    if is_banded(vae):
        return
    decoder = vae.decoder
    _override(decoder, _decoder_forward, band_bytes)
    for up_block in decoder.up_blocks:
        for resnet in up_block.resnets:
            _override(resnet, _resnet_forward, band_bytes)
        for upsampler in up_block.upsamplers or ():
            _override(upsampler, _upsampler_forward, band_bytes)


def disable_banded_decode(vae) -> None:
    for module in vae.modules():
        if module.__dict__.pop(_MARK, None) is not None:
            module.__dict__.pop("forward", None)


def is_banded(vae) -> bool:
    decoder = getattr(vae, "decoder", None)
    return decoder is not None and _MARK in decoder.__dict__


def _override(module, function, band_bytes: int) -> None:
    module.__dict__[_MARK] = True
    module.forward = functools.partial(function, module, band_bytes)


# --- support checks ----------------------------------------------------------------------------


def _is_plain_conv3(conv) -> bool:
    return (
        isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (3, 3) and conv.stride == (1, 1)
        and conv.padding == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros"
    )


def _is_plain_conv1(conv) -> bool:
    return (
        isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
        and conv.padding == (0, 0) and conv.groups == 1
    )


def _resnet_reason(resnet) -> str | None:
    if type(resnet).__name__ != "ResnetBlock2D":
        return f"{type(resnet).__name__} is not a ResnetBlock2D"
    if resnet.upsample is not None or resnet.downsample is not None:
        return "a resnet resamples inside the block"
    if not (isinstance(resnet.norm1, torch.nn.GroupNorm) and isinstance(resnet.norm2, torch.nn.GroupNorm)):
        return "a resnet's norms are not GroupNorm"
    if not isinstance(resnet.nonlinearity, torch.nn.SiLU):
        return "a resnet's activation is not SiLU"
    if not (_is_plain_conv3(resnet.conv1) and _is_plain_conv3(resnet.conv2)):
        return "a resnet's convs are not plain 3x3 convs"
    if resnet.conv_shortcut is not None and not _is_plain_conv1(resnet.conv_shortcut):
        return "a resnet's shortcut is not a 1x1 conv"
    return None


def _upsampler_reason(upsampler) -> str | None:
    if type(upsampler).__name__ != "Upsample2D":
        return f"{type(upsampler).__name__} is not an Upsample2D"
    if upsampler.norm is not None or upsampler.use_conv_transpose or not upsampler.interpolate or not upsampler.use_conv:
        return "an upsampler is not 'nearest 2x then 3x3 conv'"
    conv = upsampler.conv if upsampler.name == "conv" else upsampler.Conv2d_0
    if not _is_plain_conv3(conv):
        return "an upsampler's conv is not a plain 3x3 conv"
    return None


# --- banded forwards -----------------------------------------------------------------------------


def walk_decoder(decoder, sample, latent_embeds, *, resnet_forward, upsampler_forward, output_forward,
                 layers_ready=weights_ready):
    """The decoder's forward walked layer by layer, as both banded decodes run it (this one and
    memfit.run.compiled_banded_decode): conv_in and the mid block called as they are, then
    ``resnet_forward(resnet, sample)`` and ``upsampler_forward(upsampler, sample)`` for each layer of the up
    path and ``output_forward(sample)`` for conv_norm_out -> conv_act -> conv_out, inside ``layers_ready`` of
    the modules whose weights they use. With latent_embeds, or training under autograd, the decoder's own
    forward instead."""
    if latent_embeds is not None or (torch.is_grad_enabled() and decoder.training):
        return type(decoder).forward(decoder, sample, latent_embeds)
    sample = decoder.conv_in(sample)
    sample = decoder.mid_block(sample, None)
    for up_block in decoder.up_blocks:
        # The block's layers one by one, not up_block(sample): a call would hold the block's input
        # (as this frame's variable and the call's argument) until the block returns, beside every
        # later layer's output; here each layer's input is dropped as soon as the layer returns.
        with layers_ready(up_block):
            for resnet in up_block.resnets:
                sample = resnet_forward(resnet, sample)
            for upsampler in up_block.upsamplers or ():
                sample = upsampler_forward(upsampler, sample)
    with layers_ready(decoder.conv_norm_out, decoder.conv_out):
        return output_forward(sample)


def _decoder_forward(decoder, band_bytes, sample, latent_embeds=None):
    # Each up-path layer through its module call: its banded forward (below), memfit's hooks firing around it.
    return walk_decoder(decoder, sample, latent_embeds,
                        resnet_forward=lambda resnet, sample: resnet(sample, None),
                        upsampler_forward=lambda upsampler, sample: upsampler(sample),
                        output_forward=lambda sample: _norm_act_conv(sample, decoder.conv_norm_out,
                                                                     decoder.conv_out, band_bytes))


@contextlib.contextmanager
def band_heap(band_bytes: int):
    """A banded op's temporaries (each under band_bytes) from the heap, and that heap handed back to
    the OS as soon as the op is done. Raised for the whole decode instead, the mid block's and the
    64x64 level's 8 MiB tensors also landed in the heap and left ~95 MiB of it fragmented at the
    decode's peak (measured, SD 1.5 fp32 512x512)."""
    with heap_for_temporaries_under(band_bytes):
        try:
            yield
        finally:
            _trim_heap()


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _resnet_forward(resnet, band_bytes, input_tensor, temb=None, *args, **kwargs):
    if temb is not None or args or kwargs or (torch.is_grad_enabled() and resnet.training):
        return type(resnet).forward(resnet, input_tensor, temb, *args, **kwargs)
    layers = [resnet.norm1, resnet.conv1, resnet.norm2, resnet.conv2, resnet.conv_shortcut]
    with weights_ready(*(layer for layer in layers if layer is not None)):
        hidden = _norm_act_conv(input_tensor, resnet.norm1, resnet.conv1, band_bytes)
        return _norm_act_conv(hidden, resnet.norm2, resnet.conv2, band_bytes, residual=input_tensor,
                              shortcut=resnet.conv_shortcut, output_scale=resnet.output_scale_factor, overwrite=True)


def _upsampler_forward(upsampler, band_bytes, hidden_states, output_size=None, *args, **kwargs):
    if output_size is not None or args or kwargs:
        return type(upsampler).forward(upsampler, hidden_states, output_size, *args, **kwargs)
    conv = upsampler.conv if upsampler.name == "conv" else upsampler.Conv2d_0
    with weights_ready(conv):
        return _upsample_conv(hidden_states, conv, band_bytes)


# --- banded primitives ---------------------------------------------------------------------------


def rows_per_band(channels_in: int, channels_out: int, width: int, element_size: int, band_bytes: int) -> int:
    # per output row: the input band in fp32 (normalized) and its dtype copy, plus the conv output
    per_row = width * (channels_in * (4 + element_size) + channels_out * element_size)
    return max(1, band_bytes // max(1, per_row))


def group_stats(x: torch.Tensor, norm: torch.nn.GroupNorm, band_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, group) mean and 1/std over the whole tensor, a few groups at a time, in fp32.

    The statistics come from torch's own group-norm kernel run on channel slices (groups are
    independent, so they are the full tensor's statistics, bit for bit in fp32). For other dtypes the
    kernel runs with fp32 weights, which makes it return its fp32 statistics rather than rounding them
    to the tensor's dtype: SDXL's VAE at 1024x1024 in bf16, 0.24 s a tensor against 1.1 s for var_mean
    over an fp32 copy, which agrees to 1e-10 (mean) and 1.2e-7 (relative, 1/std).
    """
    n, channels = x.shape[:2]
    groups = norm.num_groups
    per_group = channels // groups
    group_bytes = x[0, :per_group].numel() * 4 * n
    step = max(1, band_bytes // max(1, group_bytes))
    means, rstds = [], []
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        part = x[:, g0 * per_group:g1 * per_group].contiguous()
        ones = None if x.dtype == torch.float32 else torch.ones(part.shape[1])
        zeros = None if ones is None else torch.zeros_like(ones)
        _, mean, rstd = torch.native_group_norm(part, ones, zeros, n, part.shape[1], part[0, 0].numel(), g1 - g0,
                                                norm.eps)
        means.append(mean.view(n, -1).float())
        rstds.append(rstd.view(n, -1).float())
    return torch.cat(means, 1), torch.cat(rstds, 1)


def channel_affine(norm: torch.nn.GroupNorm, mean: torch.Tensor, rstd: torch.Tensor, channels: int):
    """GroupNorm as y = x * scale + shift per (sample, channel), fused the way torch's CPU kernel
    fuses it (scale = rstd * gamma, shift = fma(-scale, mean, beta), y = fma(x, scale, shift)),
    which makes the fp32 result bitwise equal to nn.GroupNorm here."""
    per_group = channels // norm.num_groups
    scale = rstd.repeat_interleave(per_group, dim=1)
    mean = mean.repeat_interleave(per_group, dim=1)
    if norm.weight is not None:
        scale = scale * norm.weight.float()
        shift = torch.addcmul(norm.bias.float().expand_as(mean), -scale, mean)
    else:
        shift = -scale * mean
    return scale[:, :, None, None], shift[:, :, None, None]


def _norm_act_conv(
    x: torch.Tensor, norm, conv, band_bytes: int, *, residual: torch.Tensor | None = None, shortcut=None,
    output_scale: float = 1.0, overwrite: bool = False,
) -> torch.Tensor:
    """conv(silu(norm(x))), computed in bands of rows; with ``residual``,
    (shortcut(residual) + that) / output_scale, as ResnetBlock2D computes it.

    overwrite writes the result over ``x`` (same channel count): rows above the current band are
    already output, so the one input row the band's halo needs from there is kept in ``above``.
    """
    n, channels, height, width = x.shape
    channels_out = conv.out_channels
    overwrite = overwrite and channels_out == channels
    scale, shift = channel_affine(norm, *group_stats(x, norm, band_bytes), channels)
    out = x if overwrite else x.new_empty((n, channels_out, height, width))
    rows = rows_per_band(channels, channels_out, width, x.element_size(), band_bytes)
    with band_heap(band_bytes):
        _norm_act_conv_bands(x, out, conv, scale, shift, rows, residual, shortcut, output_scale, overwrite)
    return out


def _norm_act_conv_bands(x, out, conv, scale, shift, rows, residual, shortcut, output_scale, overwrite) -> None:
    height = x.shape[2]
    # A quantized convolution's weight dequantized once for every band (memfit.quant.layers).
    weight = layer_weight(conv, x.dtype)
    shortcut_weight = layer_weight(shortcut, x.dtype) if shortcut is not None else None
    above = None
    for r0 in range(0, height, rows):
        r1 = min(height, r0 + rows)
        below_end = min(height, r1 + 1)
        if r0 == 0:
            band = x[:, :, 0:below_end]
        elif overwrite:
            band = torch.cat([above, x[:, :, r0:below_end]], dim=2)
        else:
            band = x[:, :, r0 - 1:below_end]
        normalized = torch.addcmul(shift, band if band.dtype == torch.float32 else band.float(), scale)
        activated = F.silu(normalized.to(x.dtype), inplace=True)
        padded = F.pad(activated, (0, 0, 1 if r0 == 0 else 0, 1 if r1 == height else 0))
        y = F.conv2d(padded, weight, conv.bias, padding=(0, 1))
        if residual is not None:
            skip = residual[:, :, r0:r1]
            if shortcut is not None:
                skip = F.conv2d(skip, shortcut_weight, shortcut.bias)
            y = skip + y
            if output_scale != 1.0:
                y = y / output_scale
        if overwrite:
            above = x[:, :, r1 - 1:r1].clone()
        out[:, :, r0:r1] = y


def _upsample_conv(x: torch.Tensor, conv, band_bytes: int) -> torch.Tensor:
    """conv(nearest_2x(x)) in bands of output rows; the 2x tensor never exists whole."""
    n, channels, height, width = x.shape
    out_height, out_width = 2 * height, 2 * width
    out = x.new_empty((n, conv.out_channels, out_height, out_width))
    rows = max(2, rows_per_band(channels, conv.out_channels, out_width, x.element_size(), band_bytes) // 2 * 2)
    weight = layer_weight(conv, x.dtype)
    with band_heap(band_bytes):
        for r0 in range(0, out_height, rows):
            r1 = min(out_height, r0 + rows)
            need0, need1 = max(0, r0 - 1), min(out_height, r1 + 1)  # upsampled rows the band reads
            src0, src1 = need0 // 2, (need1 - 1) // 2 + 1
            upsampled = F.interpolate(x[:, :, src0:src1], scale_factor=2.0, mode="nearest")
            band = upsampled[:, :, need0 - 2 * src0:need1 - 2 * src0]
            padded = F.pad(band, (0, 0, 1 if r0 == 0 else 0, 1 if r1 == out_height else 0))
            out[:, :, r0:r1] = F.conv2d(padded, weight, conv.bias, padding=(0, 1))
    return out
