"""A family's stages as planner inputs, from configs alone: what ``memfit plan`` places.

The family's adapter (memfit.models.families) says which components each stage runs and which
part of a component (the VAE's decoder half); memfit.plan.meta sizes each on the meta device;
memfit.plan.activations gives each stage's strategies with the same rules a run uses, and
``choose_strategies`` picks among them the way a run does (memfit.plan.activations.choose).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TypeVar

from memfit.errors import MemfitError
from memfit.plan.activations import Strategy, choose, stage_strategies, vae_execution_dtype
from memfit.plan.budget import Budget, StageDoesNotFit
from memfit.plan.planner import StageInput, make_plan, phase_stages, stage_input

__all__ = ["DEFAULT_STEPS", "STAGES", "choose_strategies", "default_frames", "planned_components", "planned_models",
           "planned_with_heap_where_it_fits", "stage_options"]

DEFAULT_STEPS = 30
STAGES = ("encode", "denoise", "decode")


def planned_components(adapter) -> dict[str, list[str]]:
    """Per stage, the components of ``adapter`` that are torch models (what the plan places)."""
    from memfit.plan.meta import is_model_class  # imports diffusers/transformers

    return {stage: [name for name in adapter.stage_components(stage)
                    if name in adapter.classes and is_model_class(*adapter.classes[name])]
            for stage in STAGES}


def planned_models(adapter) -> list[str]:
    """Every component that some stage of ``adapter`` places (planned_components), once each."""
    return list(dict.fromkeys(name for names in planned_components(adapter).values() for name in names))


def stage_options(adapter, *, dtype: str, width: int, height: int, steps: int = DEFAULT_STEPS,
                  num_frames: int | None = None,
                  heap_temporaries: bool = False) -> list[list[tuple[Strategy, StageInput]]]:
    """Per stage, its (Strategy, StageInput) options, the pipeline's own way first. A stage whose experts run
    one at a time (PipelineAdapter.experts: Wan 2.2's) is a stage per expert, "denoise:transformer", ...:
    the plan then needs the larger expert, not both. ``num_frames``: a video's frames (default: its pipeline's).
    ``heap_temporaries``: the denoising loop's heap counted (memfit.plan.activations.heap_slack), as a CPU run
    plans it where the budget has room."""
    from memfit.plan.meta import measure_component  # imports torch: only when planning

    components = planned_components(adapter)
    if not any(name in components["denoise"] for name in adapter.denoise_components) or not components["decode"]:
        raise MemfitError(
            f"{adapter.class_name} has no denoiser or no vae among the models memfit can size "
            f"({sorted(adapter.classes)}); memfit plans text-to-image and text-to-video pipelines."
        )
    # A text-to-image run's settings ("text2img": the task of PipelineAdapter.tasks); plan has no input image.
    frames = num_frames if num_frames is not None and adapter.makes_video else default_frames(adapter)
    settings = SimpleNamespace(width=width, height=height, num_frames=frames, true_cfg_scale=1.0,
                               task="text2img")
    result = []
    for stage in STAGES:
        sizes = {}
        for name in components[stage]:
            library, class_name = adapter.classes[name]
            config = adapter.configs[name]
            component_dtype = vae_execution_dtype(config, dtype) if stage == "decode" else dtype
            measured = adapter.measured_sizes.get(name)
            size = measured(component_dtype) if measured is not None else \
                measure_component(name, library, class_name, config, component_dtype)
            parts = adapter.stage_parts.get(stage, {}).get(name)
            if parts and any(block.name.split(".")[0] in parts for block in size.blocks):
                size = size.select(parts)  # another VAE class without these parts is planned whole, as a run does
            sizes[name] = size
        runs = steps if stage == "denoise" else 1
        strategies = stage_strategies(adapter, stage, settings, True, dtype, heap_temporaries=heap_temporaries)
        # Experts that run one at a time are a stage each, with the stage's other components, as a run plans them.
        for name, members, homed in phase_stages(stage, sizes, adapter.present_experts(sizes)):
            result.append([(strategy, stage_input(name, [sizes[m] for m in members], strategy.activation_bytes,
                                                  runs=runs, homed=homed)) for strategy in strategies])
    return result


def default_frames(adapter) -> int:
    """The frames a video pipeline makes by default (PipelineAdapter.default_num_frames); 1 for images."""
    return adapter.default_num_frames() if adapter.makes_video else 1


def choose_strategies(options, budget: Budget, *, prefetch: int = 1) -> tuple[list[StageInput], dict[str, Strategy]]:
    """Per stage, the strategy a run would choose under ``budget`` (memfit.plan.activations.choose)."""
    stages, chosen = [], {}
    for stage_options_ in options:
        by_bytes = {strategy.activation_bytes: stage for strategy, stage in stage_options_}
        strategy, _ = choose([strategy for strategy, _ in stage_options_],
                             lambda activations: make_plan([by_bytes[activations]], budget, prefetch=prefetch))
        stages.append(by_bytes[strategy.activation_bytes])
        chosen[stages[-1].name] = strategy
    return stages, chosen


Planned = TypeVar("Planned")


def planned_with_heap_where_it_fits(plan: Callable[[bool], Planned], heap_temporaries: bool) -> tuple[Planned, bool]:
    """``plan(heap_temporaries)`` and whether it counted the heap, by the rule a run and ``memfit plan`` share:
    on the CPU (``heap_temporaries``) the denoising loop takes its temporaries from the heap, whose slack
    (memfit.plan.activations.heap_slack) is counted with the activations where the budget has room for it;
    where that plan does not fit (StageDoesNotFit), the stage is planned (and run) without the heap rather than
    refused. ``plan(heap_temporaries)`` makes the plan with or without the heap counted."""
    if not heap_temporaries:
        return plan(False), False
    try:
        return plan(True), True
    except StageDoesNotFit:
        return plan(False), False
