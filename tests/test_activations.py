"""Activation strategies under a budget (memfit.plan.activations): which one the plan picks, and that the
image stays the same when it picks a bounded one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import memfit
from memfit.testing.runtimes import WeightsOnlyCpu
from memfit.plan import meta
from memfit.plan.activations import Strategy, choose, stage_strategies
from memfit.errors import MemfitError
from memfit.plan.planner import BlockSpec, StageInput, make_plan

MiB = 2**20


def _planner(weights=(40 * MiB, 30 * MiB, 30 * MiB), budget=150 * MiB):
    blocks = tuple(BlockSpec("unet", f"b{i}", size) for i, size in enumerate(weights))
    return lambda activations: make_plan([StageInput("denoise", blocks, activations)], budget)


def test_plain_strategy_when_everything_fits():
    options = [Strategy("plain", 40 * MiB), Strategy("banded", 20 * MiB)]
    chosen, plan = choose(options, _planner())
    assert chosen.name == "plain" and plan.stages[0].streamed_from_disk_bytes == 0


def test_cheap_bounded_strategy_when_it_keeps_more_resident():
    options = [Strategy("plain", 80 * MiB), Strategy("banded", 40 * MiB)]
    chosen, plan = choose(options, _planner())
    assert chosen.name == "banded"
    assert plan.stages[0].resident_bytes > _planner()(80 * MiB).stages[0].resident_bytes


def test_costly_strategy_only_when_nothing_cheaper_plans():
    options = [Strategy("batched", 80 * MiB), Strategy("split", 40 * MiB, cheap=False)]
    assert choose(options, _planner())[0].name == "batched"  # streams, but plans
    options = [Strategy("batched", 120 * MiB), Strategy("split", 60 * MiB, cheap=False)]
    assert choose(options, _planner())[0].name == "split"  # batched cannot even stream
    with pytest.raises(MemfitError, match="smallest budget that works"):
        choose([Strategy("batched", 200 * MiB), Strategy("split", 140 * MiB, cheap=False)], _planner())


def test_strategies_follow_the_pipeline(tiny_models, monkeypatch):
    from memfit.models.folder import ModelFolder

    # Without the calibrated fixed workspace, which outweighs a tiny model's activations.
    monkeypatch.setattr(meta, "ACTIVATION_OFFSETS", dict.fromkeys(meta.ACTIVATION_OFFSETS, 0))

    for kind, denoise, decode in (("sd", ["batched", "chunked", "split"], ["plain", "banded"]),
                                  ("cogview4", ["batched"], ["plain", "banded"])):
        adapter = ModelFolder.open(tiny_models(kind)).adapter
        settings = adapter.resolve("a cat", None, 2, 4.0, 0, 64, 64)
        assert [s.name for s in stage_strategies(adapter, "denoise", settings, True, "fp32")] == denoise
        assert [s.name for s in stage_strategies(adapter, "decode", settings, True, "fp32")] == decode
        batched, *rest = stage_strategies(adapter, "denoise", settings, True, "fp32")
        for bounded in rest:
            assert bounded.activation_bytes < batched.activation_bytes


@pytest.mark.slow
def test_tight_budget_decodes_banded_with_the_same_image(tiny_models, monkeypatch):
    """A budget that holds the VAE's weights and the banded decode's activations, not the plain
    decode's: the plan picks banded, the report says so and predicts the stage peak, and the image
    equals the unbudgeted one (up to PNG rounding of the <= 1e-5 float tolerance)."""
    from memfit.models.folder import ModelFolder

    # Calibrated offsets are real-size kernel workspace; a tiny model's activations are the
    # proportional part only, which keeps the budget arithmetic below about this model.
    monkeypatch.setattr(meta, "ACTIVATION_OFFSETS", dict.fromkeys(meta.ACTIVATION_OFFSETS, 0))
    folder = tiny_models("sd")
    model = ModelFolder.open(folder)
    settings = model.adapter.resolve("a red circle", None, 2, 4.0, 0, 128, 128)
    plain, banded = stage_strategies(model.adapter, "decode", settings, True, "fp32")
    vae = model.load_stage(["vae"], torch.float32, torch.device("cpu")).vae
    vae_bytes = sum(p.numel() * p.element_size() for p in [*vae.parameters(), *vae.buffers()])
    budget = vae_bytes + (plain.activation_bytes + banded.activation_bytes) // 2

    kwargs = dict(model=folder, steps=2, guidance=4.0, width=128, height=128, progress=False)
    reference = memfit.generate("a red circle", **kwargs)
    # The process's own memory (Python, torch) would swamp a tiny model: count only what memfit places.
    fitted = memfit.generate("a red circle", budget=budget, device=WeightsOnlyCpu(), **kwargs)
    decode = fitted.report.stages[-1]
    assert decode.strategy == "banded"
    assert decode.planned_peak_bytes is not None and decode.planned_peak_bytes <= budget
    assert any("decode: banded" in note for note in fitted.report.notes)
    difference = np.abs(np.asarray(fitted.images[0], dtype=int) - np.asarray(reference.images[0], dtype=int))
    assert difference.max() <= 1
