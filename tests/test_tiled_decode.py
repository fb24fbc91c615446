"""A VAE that decodes a whole video at once (HunyuanVideo 1.5, LTX-Video, LTX-2) or a very large image (HunyuanImage
2.1) decodes in diffusers' own tiles (vae.enable_tiling) where its untiled decode cannot be planned in the budget
(memfit.plan.tiled_decode): the largest tile that fits, the output equal to diffusers' with that tiling, the report
and `memfit plan` saying so; untiled wherever the budget holds the untiled decode."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import memfit
from memfit.cli.app import main
from memfit.models.folder import ModelFolder
from memfit.plan import meta
from memfit.plan.activations import StrategyKind, stage_strategies
from memfit.plan.tiled_decode import decode_tilings
from memfit.testing import diffusers_output, generated_output, max_pixel_difference

PROMPT = "a red house near the sea"
VIDEO = dict(steps=2, guidance=4.0, seed=7, width=32, height=32, frames=5, negative_prompt="blurry")
FAMILIES = ("hunyuan_video15", "ltx", "hunyuan_image")
# Each family's request: large enough for its smallest tile (LTX's 32 pixels, HunyuanImage's 8) to cut it.
REQUESTS = {"hunyuan_video15": VIDEO, "ltx": dict(VIDEO, width=64),
            "hunyuan_image": dict(steps=2, guidance=4.0, seed=7, width=64, height=64, negative_prompt="blurry")}


def decoded_shape(output: torch.Tensor) -> tuple:
    """(frames, height, width) of a decoded video, (height, width) of an image."""
    return tuple(output.shape[2:])


def _vae(model: str):
    import diffusers

    folder = ModelFolder.open(model)
    class_name = folder.adapter.classes["vae"][1]
    return getattr(diffusers, class_name).from_pretrained(f"{model}/vae").eval(), folder.adapter


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiles_planned_are_those_diffusers_decodes(family, tiny_models):
    """The tiles a plan counts (their number and sizes) are the ones diffusers' tiled_decode runs its decoder on,
    for every tiling memfit may ask for; the largest tile comes first and none covers the whole video."""
    vae, adapter = _vae(tiny_models(family))
    scale, vae_class = adapter.vae_scale_factor(), adapter.classes["vae"][1]
    width, height, frames = 48, 32, 5
    latent_frames = adapter.latent_frames(SimpleNamespace(num_frames=frames))
    tilings = decode_tilings(vae_class, vae.config, scale, width, height)
    assert tilings and [t.tile for t in tilings] == sorted((t.tile for t in tilings), reverse=True)
    assert all(t.tile < max(width, height) and t.stride < t.tile and t.stride % scale == 0 for t in tilings)
    video = adapter.makes_video
    shape = (1, vae.config.latent_channels, *((latent_frames,) if video else ()), height // scale, width // scale)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    extra = {"temb": torch.tensor([0.05])} if vae_class == "AutoencoderKLLTXVideo" else {}
    for tiling in tilings:
        decoded: list[torch.Size] = []
        hook = vae.decoder.register_forward_hook(lambda module, args, out: decoded.append(out.shape))
        vae.enable_tiling(**tiling.enable_kwargs)
        try:
            with torch.no_grad():
                output = vae.decode(latents, **extra).sample
        finally:
            hook.remove()
            vae.disable_tiling()
        assert decoded_shape(output) == ((frames,) if video else ()) + (height, width)
        assert len(decoded) == len(tiling.tile_sides(height // scale)) * len(tiling.tile_sides(width // scale))
        counted = sum(tiling.tile_sides(height // scale)) * sum(tiling.tile_sides(width // scale))
        assert sum(shape[-1] * shape[-2] for shape in decoded) == counted
    assert decode_tilings("AutoencoderKL", {}, 8, 4096, 4096) == []  # an image VAE: memfit's banded decode instead


def test_the_tiled_estimate_is_below_the_untiled_one_and_shrinks_with_the_tile(tiny_models):
    adapter = ModelFolder.open(tiny_models("hunyuan_video15")).adapter
    settings = adapter.resolve(PROMPT, None, 2, None, 0, 128, 96, num_frames=9)
    plain, *tiled = stage_strategies(adapter, "decode", settings, True, "fp32")
    assert plain.name == StrategyKind.PLAIN and plain.tiling is None
    assert tiled and all(s.name == StrategyKind.TILED and not s.cheap and s.tiling for s in tiled)
    sizes = [plain.activation_bytes, *(s.activation_bytes for s in tiled)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_too_large_untiled_runs_in_diffusers_tiles(family, tiny_models, monkeypatch):
    """A decode whose every-frame-at-once activations the budget cannot hold (a factor that stands in for a long
    video at full resolution) runs in the largest tiles that fit, and its frames are diffusers' with those tiles;
    with room for the untiled decode the same run is untiled and equal to plain diffusers."""
    model = tiny_models(family)
    video = REQUESTS[family]
    roomy = memfit.generate(PROMPT, model=model, progress=False, budget="+400MiB", **video)
    assert roomy.report.stages[-1].strategy == "plain"
    assert max_pixel_difference(generated_output(roomy), diffusers_output(model, roomy.settings)) == 0

    monkeypatch.setitem(meta.ACTIVATION_FACTORS, "vae_decoder", 4000.0)
    adapter = ModelFolder.open(model).adapter
    plain, *tiled = stage_strategies(adapter, "decode", roomy.settings, True, "fp32")
    assert plain.activation_bytes > tiled[0].activation_bytes + 100 * 2**20
    between = (plain.activation_bytes + tiled[0].activation_bytes) // 2
    ours = memfit.generate(PROMPT, model=model, progress=False, budget=f"+{between}", **video)
    decode = ours.report.stages[-1]
    assert decode.stage == "decode" and decode.strategy == "tiled"
    tiling = tiled[0].tiling
    note = next(note for note in ours.report.notes if "vae.enable_tiling(" in note)
    assert f"{tiling.tile}x{tiling.tile}-pixel tiles" in note and "a larger --budget decodes untiled" in note
    theirs = diffusers_output(model, ours.settings, vae_tiling=tiling.enable_kwargs)
    assert max_pixel_difference(generated_output(ours), theirs) == 0
    assert max_pixel_difference(generated_output(ours), generated_output(roomy)) > 0  # the blend is not the untiled arithmetic


def test_memfit_plan_names_the_tiles_and_refuses_only_below_the_smallest(capsys):
    """HunyuanVideo 1.5's default 121 frames: untiled the decode needs more than 24 GiB; tiled it plans in
    6, 12 and 24 GiB, larger tiles with more room. Below what the smallest tile needs the refusal names it."""
    import json

    tiles = []
    for budget in ("6GiB", "12GiB", "24GiB"):
        assert main(["plan", "--arch", "hunyuanvideo1.5", "--budget", budget, "--dtype", "bf16",
                     "--process-memory", "0", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["strategies"]["decode"] == "tiled"
        assert all(stage["peak_bytes"] <= memfit.parse_size(budget) for stage in report["plan"]["stages"])
        tiles.append(report["vae_tiling"]["decode"]["tile_sample_min_height"])
    assert tiles == sorted(tiles) and tiles[0] < tiles[-1]
    assert main(["plan", "--arch", "hunyuanvideo1.5", "--budget", "24GiB", "--dtype", "bf16",
                 "--process-memory", "0"]) == 0
    out = capsys.readouterr().out
    untiled = re.search(r"decode: tiled instead of plain, which would need (\d+\.\d+) GiB", out)
    assert untiled and float(untiled[1]) > 24 and "vae.enable_tiling(" in out
    assert main(["plan", "--arch", "hunyuanvideo1.5", "--budget", "3GiB", "--dtype", "bf16", "--process-memory", "0",
                 "--width", "1280", "--height", "720"]) != 0
    assert "GiB for the decode stage with every weight streamed" in capsys.readouterr().err
