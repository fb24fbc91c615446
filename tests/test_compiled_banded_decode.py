"""The compiled decode in bounded memory (memfit.run.compiled_banded_decode) and how a run chooses it.

A compiled VAE decodes in bands where decoding it whole does not fit: under a budget, beside what the process
holds (a Session's kept denoiser); with no budget, where it would lift the process above the peak it already
reached. The kernels compute what the plain decode computes (PyTorch: within float rounding; compiled with
OpenVINO: within its fp32 tolerance, 1e-4, of the decode compiled whole).
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
import torch

GiB = 2**30
needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")


def _vae(channels=(32, 64, 64), layers_per_block=1, seed=0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(block_out_channels=list(channels), down_block_types=["DownEncoderBlock2D"] * len(channels),
                        up_block_types=["UpDecoderBlock2D"] * len(channels), latent_channels=4, norm_num_groups=8,
                        layers_per_block=layers_per_block).eval()
    for p in vae.parameters():  # random init leaves GroupNorm at identity; exercise the affine too
        p.data.add_(torch.randn_like(p) * 0.02)
    return vae


def _decode(vae, z):
    with torch.inference_mode():
        return vae.decode(z).sample


def test_decode_in_bands_only_where_decoding_whole_would_lift_the_peak():
    from memfit.plan.compiled import decode_in_bands

    held = dict(already_used=4 * GiB, compiled_bytes=GiB // 4, plain=GiB, banded=GiB // 2)
    assert decode_in_bands(ceiling=5 * GiB, **held)  # beside a kept denoiser: whole would pass the peak
    assert not decode_in_bands(ceiling=6 * GiB, **held)  # a one-shot run has room under its denoise peak
    assert not decode_in_bands(ceiling=None, **held)
    assert not decode_in_bands(ceiling=5 * GiB, **{**held, "banded": None})  # a VAE that cannot be banded
    assert not decode_in_bands(ceiling=5 * GiB, **{**held, "banded": 2 * GiB})  # bands that would not help
    # both would pass the peak by about as much (SD 1.5 at 512x512 beside its kept UNet): whole, the faster
    assert not decode_in_bands(ceiling=4 * GiB, **{**held, "plain": GiB // 2, "banded": GiB * 7 // 16})
    assert decode_in_bands(ceiling=4 * GiB, **{**held, "plain": 2 * GiB, "banded": GiB // 2})


def test_the_compiled_bands_are_planned_at_what_they_were_measured_to_hold_and_run_whole_where_they_save_a_third():
    """SDXL's VAE at 1024x1024 in bf16 beside a kept compiled UNet, no budget (measured: the process had peaked at
    5.99 GiB in the denoise and held 5.96 GiB as the decode began): in bands the decode peaked 1.15-1.25 GiB above
    what it held without the UNet's buffers (5.87 GiB with the compiled VAE), decoding whole 2.04 GiB. The plan
    counts at least what the bands held, and with that the decode runs whole: bands would save a third of the rise
    for a quarter more time (SDXL: 45 against 35 s)."""
    from memfit.models.archs import get_arch
    from memfit.plan.compiled import compiled_bands_extra, decode_in_bands
    from memfit.plan.meta import activation_estimate

    vae = get_arch("sdxl").configs["vae"]
    size = dict(width=1024, height=1024)
    banded = activation_estimate("vae_decoder_banded", vae, dtype="bf16", **size) + compiled_bands_extra(vae, dtype="bf16", **size)
    plain = activation_estimate("vae_decoder", vae, dtype="bf16", **size)
    assert banded >= 1.15 * GiB
    assert plain >= 1.85 * GiB  # measured 2.04 GiB with the 0.16 GiB compiled VAE
    held = dict(already_used=int(5.96 * GiB), compiled_bytes=int(0.156 * GiB), plain=plain)
    assert not decode_in_bands(ceiling=int(5.99 * GiB), banded=banded, **held)
    assert decode_in_bands(ceiling=int(5.99 * GiB), banded=int(0.86 * GiB), **held)  # the earlier plan's figure


@pytest.mark.parametrize("band_bytes", [64 * 1024, 16 * 2**20])
def test_band_kernels_in_pytorch_decode_what_the_plain_decode_does(band_bytes):
    from memfit.run.compiled_banded_decode import band_kernel_paths, enable_compiled_banded_decode, is_compiled_banded

    vae = _vae()
    z = torch.randn(2, 4, 24, 20, generator=torch.Generator().manual_seed(1))
    plain = _decode(vae, z)
    enable_compiled_banded_decode(vae, band_bytes=band_bytes)
    assert is_compiled_banded(vae)
    paths = band_kernel_paths(vae)
    assert "decoder.conv_out" in paths and "decoder.up_blocks.0.upsamplers.0.conv" in paths
    banded = _decode(vae, z)
    assert banded.shape == plain.shape and (banded - plain).abs().max().item() <= 1e-5


@needs_openvino
def test_compiled_band_kernels_decode_what_the_decode_compiled_whole_does():
    import types

    from memfit.compile.backends.openvino import OpenVINOBackend
    from memfit.compile.entry_points import compile_components
    from memfit.run.compiled_banded_decode import compile_band_kernels, enable_compiled_banded_decode

    vae = _vae(channels=(16, 16), layers_per_block=0)
    z = torch.randn(1, 4, 12, 10, generator=torch.Generator().manual_seed(2))
    whole_vae = _vae(channels=(16, 16), layers_per_block=0)
    compile_components(types.SimpleNamespace(components={"vae": whole_vae}), {"vae": "openvino"}, cache=False)
    whole = _decode(whole_vae, z)
    enable_compiled_banded_decode(vae, band_bytes=4 * 1024)  # several bands per layer
    records = compile_band_kernels(vae, "vae", "openvino", cache=False)
    banded = _decode(vae, z)
    assert {record.status.value for record in records} == {"compiled"}
    assert all(record.component.startswith("vae/decoder.") for record in records)
    assert (banded - whole).abs().max().item() <= OpenVINOBackend.float32_tolerance
    assert torch.equal(_decode(vae, z), banded)  # a second image reuses the kernels


# --- the choice inside a run: a Session under a budget keeps its denoiser where the banded decode fits beside it ----


@pytest.fixture
def decode_estimates(monkeypatch):
    """Set the decode's planned activations (whole, in bands) and make the process's memory in use a fixed 1 GiB
    plus 1024x the weights a Session keeps: the tiny pipeline's kept stages then weigh in the plan as a real-size
    denoiser does. The band kernels run in PyTorch (compiling them is tested above), so nothing is compiled."""
    import memfit.run.compiled_banded_decode as compiled_banded
    import memfit.run.fit as fit
    from memfit.devices import DeviceRuntime
    from memfit.plan.activations import Strategy, StrategyKind

    real = fit.stage_strategies
    sizes = {}
    pools = []

    def strategies(adapter, stage, *args, **kwargs):
        options = real(adapter, stage, *args, **kwargs)
        if stage != "decode":
            return options
        return [Strategy(StrategyKind.PLAIN, sizes["plain"]), Strategy(StrategyKind.BANDED, sizes["banded"])]

    def in_use(self):
        return GiB + 1024 * sum(pool.weights_bytes() for pool in pools)

    monkeypatch.setattr(fit, "stage_strategies", strategies)
    monkeypatch.setattr(DeviceRuntime, "memory_in_use", in_use)
    monkeypatch.setattr(compiled_banded, "compile_band_kernels", lambda *args, **kwargs: [])

    def set_sizes(plain: int, banded: int, session):
        sizes.update(plain=plain, banded=banded)
        pools.append(session.pool)

    return set_sizes


def _counting_loads(monkeypatch):
    from memfit.models.folder import ModelFolder

    loads = []
    real_load = ModelFolder.load_stage
    monkeypatch.setattr(ModelFolder, "load_stage",
                        lambda self, names, *a, **k: loads.append(tuple(names)) or real_load(self, names, *a, **k))
    return loads


def _run_three(session, prompts=("a red circle",) * 3):
    return [session.generate(prompt, steps=1, width=32, height=32, seed=seed) for seed, prompt in enumerate(prompts)]


@functools.lru_cache(maxsize=None)
def _weighs(name: str) -> int:
    """What the tiny pipeline's kept ``name`` weighs in the plan (1024x its weights, see decode_estimates)."""
    from memfit.testing import build_pipeline

    return 1024 * sum(p.numel() * p.element_size() for p in getattr(build_pipeline("sd", seed=0), name).parameters())


@needs_openvino
def test_a_budgeted_session_keeps_its_stages_where_the_banded_decode_fits_beside_them(tiny_models, decode_estimates,
                                                                                      monkeypatch):
    from memfit.run.session import Session

    session = Session(tiny_models("sd"), budget="8GiB", backend={"vae": "openvino"})
    # Whole, the decode fits nowhere; in bands it fits beside the kept text encoder and denoiser.
    decode_estimates(plain=64 * GiB, banded=7 * GiB - _weighs("text_encoder") - _weighs("unet") - GiB // 4, session=session)
    loads = _counting_loads(monkeypatch)
    runs = _run_three(session, ("a red circle", "a blue square", "a red circle"))
    assert [stage.strategy for stage in runs[0].report.stages if stage.stage == "decode"] == ["banded"]
    assert sum("unet" in names for names in loads) == 1, loads  # the denoiser loaded once, kept across the images
    assert sum("text_encoder" in names for names in loads) == 1, loads
    state = session.warm_state()
    assert state["warm"] and not state["reason"] and state["released"] == 0
    assert {"encode:text_encoder", "denoise:unet", "decode:vae"} <= set(state["components"])
    assert [stage.note for stage in runs[1].report.stages] == ["warm", "warm", "warm"]


@needs_openvino
def test_a_budgeted_session_lets_the_text_encoder_go_where_the_banded_decode_fits_beside_the_denoiser_only(
        tiny_models, decode_estimates, monkeypatch):
    from memfit.run.session import Session

    session = Session(tiny_models("sd"), budget="8GiB", backend={"vae": "openvino"})
    decode_estimates(plain=64 * GiB, banded=7 * GiB - _weighs("unet") - _weighs("text_encoder") // 2, session=session)
    loads = _counting_loads(monkeypatch)
    runs = _run_three(session, ("a red circle", "a blue square", "a green circle"))
    assert sum("unet" in names for names in loads) == 1, loads  # kept across the images
    assert sum("text_encoder" in names for names in loads) == 3, loads  # let go, and loaded per new prompt since
    state = session.warm_state()
    assert state["warm"] and state["released"] == 1 and "denoise:unet" in state["components"]
    assert not any(name.startswith("encode:") for name in state["components"])
    assert [stage.note for stage in runs[2].report.stages if stage.stage != "encode"] == ["warm", "warm"]


@needs_openvino
def test_a_budgeted_session_lets_its_denoiser_go_where_even_the_banded_decode_does_not_fit_beside_it(
        tiny_models, decode_estimates, monkeypatch):
    import memfit
    from memfit.run.session import Session

    folder = tiny_models("sd")
    session = Session(folder, budget="8GiB", backend={"vae": "openvino"})
    # In bands the decode fits alone (1 GiB in use), not beside the kept denoiser.
    decode_estimates(plain=64 * GiB, banded=7 * GiB - _weighs("unet") // 2, session=session)
    loads = _counting_loads(monkeypatch)
    runs = _run_three(session)
    assert sum("unet" in names for names in loads) == 3, loads  # let go for the decode, loaded for every image
    state = session.warm_state()
    assert state["released"] == 2 and not any(name.startswith("denoise:") for name in state["components"])
    assert [stage.strategy for stage in runs[0].report.stages if stage.stage == "decode"] == ["banded"]
    # The image is the one-shot run's (which plans every stage alone and decodes in bands as well).
    session.close()
    plain = memfit.generate("a red circle", model=folder, steps=1, width=32, height=32, seed=2, budget="8GiB",
                            backend={"vae": "openvino"}, progress=False)
    assert np.array_equal(np.asarray(runs[2].images[0]), np.asarray(plain.images[0]))


@needs_openvino
def test_a_budgeted_session_decodes_whole_once_the_denoiser_it_let_go_left_room_for_that(
        tiny_models, decode_estimates, monkeypatch):
    import memfit
    from memfit.run.session import Session

    folder = tiny_models("sd")
    session = Session(folder, budget="8GiB", backend={"vae": "openvino"})
    # Neither whole nor in bands does the decode fit beside the kept denoiser; alone, whole fits, and runs faster.
    plain = 7 * GiB - _weighs("unet") // 2
    decode_estimates(plain=plain, banded=plain - _weighs("unet") // 8, session=session)
    loads = _counting_loads(monkeypatch)
    runs = _run_three(session)
    assert sum("unet" in names for names in loads) == 3, loads  # let go for the decode, loaded for every image
    assert sum("vae" in names for names in loads) == 1, loads  # the decode's VAE kept, as it was fitted: whole
    assert "banded" not in [stage.strategy for run in runs for stage in run.report.stages if stage.stage == "decode"]
    assert "decode" not in session.pool.bounded and session.warm_state()["released"] == 2
    assert "decode: does not fit beside the kept encode:text_encoder, denoise:unet: let go" in "\n".join(runs[0].report.notes)
    session.close()
    alone = memfit.generate("a red circle", model=folder, steps=1, width=32, height=32, seed=2, budget="8GiB",
                            backend={"vae": "openvino"}, progress=False)
    assert np.array_equal(np.asarray(runs[2].images[0]), np.asarray(alone.images[0]))


@needs_openvino
def test_an_unbudgeted_session_decodes_in_bands_where_whole_would_pass_the_peak(tiny_models, decode_estimates):
    import memfit.run.fit as fit
    from memfit.run.session import Session

    session = Session(tiny_models("sd"), budget="none", backend={"vae": "openvino"})
    decode_estimates(plain=64 * GiB, banded=GiB // 4, session=session)
    first = session.generate("a red circle", steps=1, width=32, height=32)
    assert [stage.strategy for stage in first.report.stages if stage.stage == "decode"] == ["banded"]
    assert session.warm_state()["warm"] and "decode" in session.pool.bounded
    assert fit.process_peak_rss() < 64 * GiB  # the measured peak the choice compared with
