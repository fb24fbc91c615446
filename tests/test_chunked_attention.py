"""The "chunked" denoise strategy (memfit.run.chunked_attention): the batched pass with a UNet's attention
and feed-forward over chunks of query tokens, the same result as plain diffusers within float
rounding, chosen only when the batched pass cannot be planned (and before the split passes).

Stated tolerance: every token is computed from the same inputs with the same arithmetic (each
chunk's softmax is over all keys); only the matrix-multiply and attention kernels' blocking for a
chunk of rows can sum in another order, so fp32 outputs agree within 1e-5 of outputs of order 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import memfit
from memfit.testing.runtimes import WeightsOnlyCpu
from memfit.plan import meta
from memfit.run.chunked_attention import (
    ChunkedAttnProcessor,
    chunked_attention,
    disable_chunked_attention,
    enable_chunked_attention,
    is_chunked,
    tokens_per_chunk,
)

TINY_CHUNKS = 4096  # a few tokens per chunk at these widths: many chunks, and a short last one


def _unet(seed=0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=8,
    ).eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, 24, 20, generator=generator), torch.tensor(10),
            torch.randn(2, 7, 24, generator=generator))


def _run(unet, inputs):
    with torch.inference_mode():
        return unet(*inputs).sample


def test_chunks_are_a_few_tokens_at_tiny_widths():
    assert tokens_per_chunk(32, 4, TINY_CHUNKS) < 24 * 20 // 4  # the widest level has 480 tokens
    assert tokens_per_chunk(10**9, 4, TINY_CHUNKS) == 1


def test_chunked_unet_matches_plain_within_tolerance():
    unet, inputs = _unet(), _inputs()
    plain = _run(unet, inputs)
    changed = enable_chunked_attention(unet, chunk_bytes=TINY_CHUNKS)
    assert changed == 8 and is_chunked(unet)  # self- and cross-attention of 4 transformer blocks
    chunked = _run(unet, inputs)
    assert chunked.shape == plain.shape
    assert (chunked - plain).abs().max().item() <= 1e-5
    assert not torch.equal(chunked, torch.zeros_like(chunked))


def test_disable_restores_every_processor_and_feed_forward():
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import AttnProcessor2_0

    unet, inputs = _unet(), _inputs()
    plain = _run(unet, inputs)
    before = {name: processor for name, processor in unet.attn_processors.items()}
    with chunked_attention(unet, chunk_bytes=TINY_CHUNKS):
        assert all(isinstance(p, ChunkedAttnProcessor) for p in unet.attn_processors.values())
    assert not is_chunked(unet)
    assert unet.attn_processors == before
    assert all(type(p) is AttnProcessor2_0 for p in unet.attn_processors.values())
    assert not any("forward" in vars(m) for m in unet.modules() if isinstance(m, FeedForward))
    assert torch.equal(_run(unet, inputs), plain)  # bitwise: the plain path again


def test_other_processors_and_masked_calls_are_left_alone():
    from diffusers.models.attention_processor import Attention, AttnProcessor

    unet = _unet()
    first = next(m for m in unet.modules() if isinstance(m, Attention))
    first.set_processor(AttnProcessor())  # not SDPA: its own arithmetic must stay
    changed = enable_chunked_attention(unet, chunk_bytes=TINY_CHUNKS)
    assert changed == 7 and type(first.processor) is AttnProcessor
    disable_chunked_attention(unet)

    attention = Attention(query_dim=16, heads=2, dim_head=8).eval()
    hidden = torch.randn(1, 12, 16)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[:, -3:] = False
    with torch.inference_mode():
        plain = attention(hidden, attention_mask=mask)
        enable_chunked_attention(attention, chunk_bytes=TINY_CHUNKS)
        assert torch.equal(attention(hidden, attention_mask=mask), plain)  # a mask goes to the inner processor
        assert (attention(hidden) - attention.processor.inner(attention, hidden)).abs().max() <= 1e-5


def test_chunked_is_planned_only_where_batched_cannot_be(tiny_models, monkeypatch):
    """Denoise floors (every weight streamed): split < chunked < batched. A budget between chunked's and
    batched's floors plans chunked (before split, which would read streamed weights twice); one
    below chunked's plans split; one that holds everything plans batched."""
    from memfit.models.folder import ModelFolder
    from memfit.plan.budget import Budget
    from memfit.plan.planner import minimum_device_bytes
    from memfit.plan.stages import choose_strategies, stage_options

    # The shape models alone (no fixed workspace), scaled so the chunked batch of two holds 1.5x the
    # activations of one whole-tensor pass: between the split pass (1x) and the batched one (2x), as
    # calibrated at real size (docs/activation_calibration.md).
    adapter = ModelFolder.open(tiny_models("sd")).adapter
    config = adapter.configs["unet"]
    whole, chunked = (meta.activation_elements(kind, config, width=256, height=256) for kind in ("unet", "unet_chunked"))
    monkeypatch.setattr(meta, "ACTIVATION_OFFSETS", dict.fromkeys(meta.ACTIVATION_OFFSETS, 0))
    monkeypatch.setattr(meta, "ACTIVATION_FACTORS", dict(meta.ACTIVATION_FACTORS, unet=1.0, unet_chunked=0.75 * whole / chunked))
    options = stage_options(adapter, dtype="fp32", width=256, height=256, steps=2)
    denoise = {strategy.name: stage for strategy, stage in options[1]}
    assert list(denoise) == ["batched", "chunked", "split"]
    floors = {name: minimum_device_bytes(stage) for name, stage in denoise.items()}
    assert floors["split"] < floors["chunked"] < floors["batched"]

    def chosen(budget: int) -> str:  # each stage is chosen on its own: only the denoise stage matters here
        return choose_strategies([options[1]], Budget(device=budget))[1]["denoise"].name

    assert chosen((floors["chunked"] + floors["batched"]) // 2) == "chunked"
    assert chosen((floors["split"] + floors["chunked"]) // 2) == "split"
    assert chosen(floors["batched"] + sum(block.bytes for block in denoise["batched"].blocks)) == "batched"


def _chunked_only_budget(tiny_models, monkeypatch) -> tuple:
    """(tiny SD folder, a budget only the chunked strategy fits at 128x128, 2 steps). Only the denoiser's
    activations count (the tiny model's weights are far smaller than real-size workspace, and the process's own
    memory would swamp it); nothing is cached."""
    from memfit.models.folder import ModelFolder
    from memfit.plan.activations import stage_strategies

    factors = dict.fromkeys(meta.ACTIVATION_FACTORS, 0.0)
    factors.update(unet=60.0, unet_chunked=30.0)
    monkeypatch.setattr(meta, "ACTIVATION_FACTORS", factors)
    monkeypatch.setattr(meta, "ACTIVATION_OFFSETS", dict.fromkeys(meta.ACTIVATION_OFFSETS, 0))
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    folder = tiny_models("sd")
    adapter = ModelFolder.open(folder).adapter
    settings = adapter.resolve("a red circle", None, 2, 4.0, 0, 128, 128)
    batched, chunked, _ = stage_strategies(adapter, "denoise", settings, True, "fp32")
    assert chunked.name == "chunked" and chunked.activation_bytes < batched.activation_bytes
    return folder, (chunked.activation_bytes + batched.activation_bytes) // 2


def _count_chunked_calls(monkeypatch) -> list:
    """A list that gets an item at every call of the chunked attention processor from now on."""
    calls = []
    original = ChunkedAttnProcessor.__call__
    monkeypatch.setattr(ChunkedAttnProcessor, "__call__",
                        lambda self, *args, **kw: calls.append(1) or original(self, *args, **kw))
    return calls


@pytest.mark.slow
def test_run_under_a_chunked_budget_makes_the_same_image(tiny_models, monkeypatch):
    """A budget only the chunked strategy fits: the run reports chunked and makes plain diffusers' image
    (within PNG rounding of the float tolerance)."""
    folder, budget = _chunked_only_budget(tiny_models, monkeypatch)
    kwargs = dict(model=folder, steps=2, guidance=4.0, width=128, height=128, progress=False)
    reference = memfit.generate("a red circle", budget="none", **kwargs)
    calls = _count_chunked_calls(monkeypatch)
    fitted = memfit.generate("a red circle", budget=budget, device=WeightsOnlyCpu(), **kwargs)
    assert calls  # the chunked attention really ran
    denoise = next(stage for stage in fitted.report.stages if stage.stage == "denoise")
    assert denoise.strategy == "chunked"
    assert any("denoise: chunked" in note for note in fitted.report.notes)
    difference = np.abs(np.asarray(fitted.images[0], dtype=int) - np.asarray(reference.images[0], dtype=int))
    assert difference.max() <= 1


@pytest.mark.slow
def test_a_session_runs_its_kept_denoiser_chunked_as_planned(tiny_models, monkeypatch):
    """A stage a Session keeps runs its next images with what its plan chose (chunked attention here), not
    with the plain strategy an unplanned load would: the budget was planned with the chunked activations."""
    from memfit.devices import runtime_for
    from memfit.run.session import Session

    folder, budget = _chunked_only_budget(tiny_models, monkeypatch)
    calls = _count_chunked_calls(monkeypatch)
    # As WeightsOnlyCpu (which a Session, made for a device name, does not take): the process holds nothing.
    monkeypatch.setattr(type(runtime_for("cpu")), "memory_in_use", lambda self: 0)
    session = Session(folder, budget=budget)
    runs = []
    for seed in (0, 1):
        calls.clear()
        runs.append(session.generate("a red circle", steps=2, guidance=4.0, width=128, height=128, seed=seed))
        assert calls, f"image {seed + 1} did not run the chunked attention"
    denoise = [next(stage for stage in run.report.stages if stage.stage == "denoise") for run in runs]
    assert [stage.note for stage in denoise] == ["", "warm"]
    assert [stage.strategy for stage in denoise] == ["chunked", "chunked"]
