"""Banded VAE decode (memfit.run.banded_decode): the untiled image within float rounding, fewer activations.

Stated tolerance: the arithmetic per output element is the same, but the convolution library may
pick another kernel (another summation order) for a band of rows than for the whole tensor, so fp32
results agree within max |difference| <= 1e-5 on images in [-1, 1]. Measured on this machine: the
SD 1.5 VAE's 3x3 convs, upsamplers and GroupNorms are bitwise equal at real sizes and only its two
1x1 shortcut convs round differently (4e-6 at 256x256); tiny widths (64 channels) also differ in
the 3x3 convs. bf16 runs stay within bf16 rounding of the plain bf16 decode (2e-2).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from memfit.run.banded_decode import (
    _norm_act_conv,
    _resnet_forward,
    disable_banded_decode,
    enable_banded_decode,
    is_banded,
    unsupported_reason,
)

SMALL_BANDS = 64 * 1024  # forces many bands, and bands of one row at the widest tensors


def _vae(seed=0, channels=(32, 64, 64), dtype=torch.float32):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=list(channels), down_block_types=["DownEncoderBlock2D"] * len(channels),
        up_block_types=["UpDecoderBlock2D"] * len(channels), latent_channels=4, norm_num_groups=8,
    ).eval()
    for p in vae.parameters():  # random init leaves GroupNorm at identity; exercise the affine too
        p.data.add_(torch.randn_like(p) * 0.02)
    return vae.to(dtype)


def _decode(vae, z):
    with torch.inference_mode():
        return vae.decode(z).sample


@pytest.mark.parametrize("bands", [SMALL_BANDS, 16 * 2**20])
def test_banded_decode_matches_plain_within_tolerance(bands):
    vae = _vae()
    z = torch.randn(2, 4, 24, 20, generator=torch.Generator().manual_seed(1))
    plain = _decode(vae, z)
    enable_banded_decode(vae, band_bytes=bands)
    assert is_banded(vae)
    banded = _decode(vae, z)
    assert type(banded) is torch.Tensor and banded.shape == plain.shape
    assert (banded - plain).abs().max().item() <= 1e-5
    disable_banded_decode(vae)
    assert not is_banded(vae)
    assert not any("forward" in vars(m) or "_memfit_banded" in vars(m) for m in vae.modules())
    assert torch.equal(_decode(vae, z), plain)


def test_banded_blocks_match_their_modules():
    from memfit.run.banded_decode import _upsampler_forward

    decoder = _vae().decoder
    resnet, upsampler = decoder.up_blocks[0].resnets[0], decoder.up_blocks[0].upsamplers[0]
    with_shortcut = decoder.up_blocks[2].resnets[0]
    assert resnet.conv_shortcut is None and with_shortcut.conv_shortcut is not None
    x = torch.randn(1, resnet.in_channels, 37, 29)
    with torch.inference_mode():
        pairs = [
            (_resnet_forward(resnet, SMALL_BANDS, x), resnet(x, None)),
            (_resnet_forward(with_shortcut, SMALL_BANDS, x), with_shortcut(x, None)),
            (_upsampler_forward(upsampler, SMALL_BANDS, x), upsampler(x)),
            (_norm_act_conv(x[:, :32], decoder.conv_norm_out, decoder.conv_out, SMALL_BANDS),
             decoder.conv_out(decoder.conv_act(decoder.conv_norm_out(x[:, :32])))),
        ]
    for banded, plain in pairs:
        assert banded.shape == plain.shape and (banded - plain).abs().max().item() <= 1e-5


def test_bf16_within_bf16_rounding():
    vae = _vae(dtype=torch.bfloat16)
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    plain = _decode(vae, z).float()
    enable_banded_decode(vae, band_bytes=SMALL_BANDS)
    banded = _decode(vae, z).float()
    # bf16 steps are 2**-7 near 1: the bands change where the decoder rounds, and how that adds up depends
    # on the CPU's bf16 kernels (measured 0.023, 3 steps, at a value of 1.03; under 0.02 on another CPU).
    assert (banded - plain).abs().max().item() <= 4 * 2**-7


def test_unsupported_decoder_is_named_not_guessed():
    vae = _vae()
    vae.decoder.up_blocks[1].resnets[0].nonlinearity = torch.nn.GELU()
    assert "activation is not SiLU" in unsupported_reason(vae)
    from memfit.errors import MemfitError

    with pytest.raises(MemfitError, match="up_blocks.1"):
        enable_banded_decode(vae)


def test_banded_decode_runs_through_offload_hooks(tiny_models):
    """Weights on the disk tier converted to bf16 by memfit's hooks: the banded path must see them
    in run form (offload.weights_ready), and the image must match the plain decode under the same plan."""
    import diffusers

    from memfit.run.executor import optimize, restore

    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny_models("sd"), torch_dtype=torch.bfloat16)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    optimize(pipe, force_tiers={"vae/*": "disk"}, model_dir=tiny_models("sd"))
    plain = _decode(pipe.vae, z)
    enable_banded_decode(pipe.vae, band_bytes=SMALL_BANDS)
    banded = _decode(pipe.vae, z)
    disable_banded_decode(pipe.vae)
    restore(pipe)
    assert (banded.float() - plain.float()).abs().max().item() <= 2e-2


_PEAK_CHILD = r"""
import gc, json, sys, torch
from diffusers import AutoencoderKL
from memfit.models.archs import get_arch
from memfit.run.banded_decode import enable_banded_decode
from memfit.run.memory import read_peak_rss, reset_peak_rss, current_rss, return_large_frees_to_os
return_large_frees_to_os()
torch.manual_seed(0)
config = [c for c in get_arch("sd15").components if c.name == "vae"][0].config
vae = AutoencoderKL.from_config(dict(config)).eval()
if sys.argv[1] == "banded":
    enable_banded_decode(vae)
with torch.inference_mode():
    vae.decode(torch.zeros(1, 4, 8, 8))
    gc.collect()
    reset_peak_rss()
    base = current_rss()
    vae.decode(torch.zeros(1, 4, 64, 64))
    print(json.dumps(read_peak_rss() - base))
"""


@pytest.mark.slow
def test_banded_decode_holds_fewer_activations():
    """The SD 1.5 VAE (real size, random weights) at 512x512, each in a fresh process. (At 256x256 the
    heap's reused temporaries, about 100 MiB either way, hide the difference.)"""
    from memfit.run.memory import reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("needs /proc/self/clear_refs to measure a peak (Linux)")
    peaks = {}
    for mode in ("plain", "banded"):
        done = subprocess.run([sys.executable, "-c", _PEAK_CHILD, mode], capture_output=True, text=True, check=True)
        peaks[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["banded"] < 0.75 * peaks["plain"], peaks


def test_an_up_blocks_input_is_freed_once_its_first_resnet_returns():
    """The block's input is not held (by a call's arguments) beside the later resnets' outputs: at the
    decode's last, widest up block that is the largest tensor of the decode."""
    import weakref

    vae = _vae()
    enable_banded_decode(vae)
    block = vae.decoder.up_blocks[-1]
    seen = {}
    block.resnets[0].register_forward_pre_hook(lambda module, args: seen.update(input=weakref.ref(args[0])))
    block.resnets[1].register_forward_pre_hook(lambda module, args: seen.update(alive=seen["input"]() is not None))
    _decode(vae, torch.randn(1, 4, 8, 8))
    assert seen["alive"] is False
