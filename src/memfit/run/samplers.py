"""Sampler names as AUTOMATIC1111 gives them, mapped to diffusers schedulers.

A name maps to a scheduler class and config overrides (diffusers' own table of A1111 equivalents,
docs "Schedulers"); the scheduler is built from the model's own scheduler config, so its training
schedule (betas, prediction type, timestep spacing) stays the model's. A name is refused when it has
no diffusers equivalent, or when its scheduler is not one the model's scheduler lists as compatible
(a flow-matching model takes no DDPM-family sampler): the caller gets the names that work.
"""

from __future__ import annotations

import contextlib
from typing import Any

from memfit.errors import MemfitError

__all__ = ["SAMPLERS", "sampler_names", "resolve_sampler", "sampler_scheduler"]

# A1111 name -> (diffusers scheduler class, config overrides).
SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "Euler": ("EulerDiscreteScheduler", {}),
    "Euler a": ("EulerAncestralDiscreteScheduler", {}),
    "LMS": ("LMSDiscreteScheduler", {}),
    "LMS Karras": ("LMSDiscreteScheduler", {"use_karras_sigmas": True}),
    "Heun": ("HeunDiscreteScheduler", {}),
    "DPM2": ("KDPM2DiscreteScheduler", {}),
    "DPM2 Karras": ("KDPM2DiscreteScheduler", {"use_karras_sigmas": True}),
    "DPM2 a": ("KDPM2AncestralDiscreteScheduler", {}),
    "DPM2 a Karras": ("KDPM2AncestralDiscreteScheduler", {"use_karras_sigmas": True}),
    "DPM++ 2M": ("DPMSolverMultistepScheduler", {}),
    "DPM++ 2M Karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "DPM++ 2M SDE": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "DPM++ 2M SDE Karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}),
    "DDIM": ("DDIMScheduler", {}),
    "PLMS": ("PNDMScheduler", {}),
    "UniPC": ("UniPCMultistepScheduler", {}),
    "DEIS": ("DEISMultistepScheduler", {}),
    "LCM": ("LCMScheduler", {}),
}
# Flow-matching models (Flux, SD3, ...) sample with their own Euler; A1111 calls it "Euler".
FLOW_EULER = "FlowMatchEulerDiscreteScheduler"


def _compatible(own_class: str) -> set[str]:
    import diffusers

    cls = getattr(diffusers, own_class, None)
    names = {own_class}
    if cls is not None:
        names |= {c if isinstance(c, str) else c.__name__ for c in getattr(cls, "_compatibles", [])}
    return names


def sampler_names(own_class: str) -> list[str]:
    """The A1111 sampler names a model whose scheduler is ``own_class`` can run."""
    if own_class == FLOW_EULER:
        return ["Euler"]
    compatible = _compatible(own_class)
    return [name for name, (cls, _) in SAMPLERS.items() if cls in compatible]


def resolve_sampler(name: str, own_class: str) -> tuple[str, dict[str, Any]]:
    """(scheduler class, config overrides) for the A1111 sampler ``name`` on a model whose own scheduler
    is ``own_class``; raises MemfitError naming the samplers that work."""
    workable = sampler_names(own_class)
    if name not in workable:
        why = "has no diffusers equivalent" if name not in SAMPLERS and name != "Euler" else \
            f"does not fit this model's {own_class}"
        raise MemfitError(f"The sampler {name!r} {why}; use one of: {', '.join(workable) or 'none (leave it out)'}.")
    return (FLOW_EULER, {}) if own_class == FLOW_EULER else SAMPLERS[name]


@contextlib.contextmanager
def sampler_scheduler(pipe, sampler: str | None):
    """While active, ``pipe`` samples with ``sampler`` (an A1111 name), built from its own scheduler's
    config; afterwards its own scheduler is back. None changes nothing."""
    if sampler is None:
        yield
        return
    import diffusers

    own = pipe.scheduler
    cls, overrides = resolve_sampler(sampler, type(own).__name__)
    pipe.scheduler = getattr(diffusers, cls).from_config(own.config, **overrides)
    try:
        yield
    finally:
        pipe.scheduler = own
