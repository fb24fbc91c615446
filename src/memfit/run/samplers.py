"""Sampler and schedule type names as AUTOMATIC1111 gives them, mapped to diffusers schedulers.

A sampler name maps to a scheduler class and config overrides (diffusers' own table of A1111
equivalents, docs "Schedulers"); a schedule type (A1111's "scheduler": Karras, Exponential, ...)
adds the config overrides diffusers' table gives for it. The scheduler is built from the model's
own scheduler config, so its training schedule (betas, prediction type) stays the model's. As in
A1111, a sampler name may carry its schedule type: "DPM++ 2M Karras" is "DPM++ 2M" with "karras".

A name is refused when it has no diffusers equivalent, when the sampler's scheduler is not one the
model's scheduler lists as compatible (a flow-matching model takes no DDPM-family sampler), or when
the schedule type is one the sampler's scheduler cannot follow: the caller gets the names that work.
"Automatic" keeps the sampler's scheduler as the model's config builds it (A1111 1.9+ picks a
schedule per sampler instead, e.g. Karras for DPM++ 2M; memfit keeps what `--sampler` always did).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from memfit.errors import MemfitError

__all__ = ["SAMPLERS", "SCHEDULES", "Schedule", "resolve_sampler", "sampler_label", "sampler_names",
           "sampler_scheduler", "schedules_for", "split_sampler"]

# A1111 name -> (diffusers scheduler class, config overrides, A1111's aliases of the name).
SAMPLERS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "Euler": ("EulerDiscreteScheduler", {}, ("k_euler",)),
    "Euler a": ("EulerAncestralDiscreteScheduler", {}, ("k_euler_a", "k_euler_ancestral")),
    "LMS": ("LMSDiscreteScheduler", {}, ("k_lms",)),
    "Heun": ("HeunDiscreteScheduler", {}, ("k_heun",)),
    "DPM2": ("KDPM2DiscreteScheduler", {}, ("k_dpm_2",)),
    "DPM2 a": ("KDPM2AncestralDiscreteScheduler", {}, ("k_dpm_2_a",)),
    "DPM++ 2M": ("DPMSolverMultistepScheduler", {}, ("k_dpmpp_2m",)),
    "DPM++ 2M SDE": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}, ("k_dpmpp_2m_sde",)),
    "DDIM": ("DDIMScheduler", {}, ("ddim",)),
    "PLMS": ("PNDMScheduler", {}, ("plms",)),
    "UniPC": ("UniPCMultistepScheduler", {}, ("unipc",)),
    "DEIS": ("DEISMultistepScheduler", {}, ()),
    "LCM": ("LCMScheduler", {}, ("k_lcm",)),
}
# Flow-matching models (Flux, SD3, ...) sample with their own Euler; A1111 calls it "Euler".
FLOW_EULER = "FlowMatchEulerDiscreteScheduler"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An A1111 schedule type: its name, label, aliases, default_rho and need_inner_model as A1111's
    /sdapi/v1/schedulers gives them, and the scheduler config overrides that follow it."""

    name: str
    label: str
    overrides: dict[str, Any]
    default_rho: float = -1.0
    need_inner_model: bool = False
    aliases: tuple[str, ...] = ()
    needs: str | None = None  # a module the overrides need: diffusers refuses beta sigmas without scipy

    def spellings(self) -> tuple[str, ...]:
        return (self.label, self.name, *self.aliases)

    def missing(self) -> str | None:
        """The module this schedule type needs and this installation lacks, or None."""
        import importlib.util

        return self.needs if self.needs is not None and importlib.util.find_spec(self.needs) is None else None


# In A1111's order. Karras keeps the model's timestep spacing, as `--sampler "... Karras"` always has.
SCHEDULES = (
    Schedule("automatic", "Automatic", {}),
    Schedule("karras", "Karras", {"use_karras_sigmas": True}, default_rho=7.0),
    Schedule("exponential", "Exponential", {"timestep_spacing": "linspace", "use_exponential_sigmas": True}),
    Schedule("sgm_uniform", "SGM Uniform", {"timestep_spacing": "trailing"}, need_inner_model=True,
             aliases=("SGMUniform",)),
    Schedule("simple", "Simple", {"timestep_spacing": "trailing"}, need_inner_model=True),
    Schedule("beta", "Beta", {"timestep_spacing": "linspace", "use_beta_sigmas": True}, need_inner_model=True,
             needs="scipy"),
)
AUTOMATIC = SCHEDULES[0]


def _compatible(own_class: str) -> set[str]:
    import diffusers

    cls = getattr(diffusers, own_class, None)
    names = {own_class}
    if cls is not None:
        names |= {c if isinstance(c, str) else c.__name__ for c in getattr(cls, "_compatibles", [])}
    return names


def _takes(scheduler_class: str, schedule: Schedule) -> bool:
    """Whether ``scheduler_class`` follows ``schedule``: from_config drops config keys a class does not
    take without a word, so a schedule it cannot take would change nothing while the PNG claims it."""
    import inspect

    import diffusers

    if schedule.missing():
        return False
    cls = getattr(diffusers, scheduler_class, None)
    if cls is None or hasattr(cls, "_backends"):  # a placeholder for a missing backend: using it says what to install
        return True
    return set(schedule.overrides) <= set(inspect.signature(cls.__init__).parameters)


def sampler_names(own_class: str) -> list[str]:
    """The A1111 sampler names a model whose scheduler is ``own_class`` can run."""
    if own_class == FLOW_EULER:
        return ["Euler"]
    compatible = _compatible(own_class)
    return [name for name, (cls, _, _) in SAMPLERS.items() if cls in compatible]


def schedules_for(own_class: str, sampler: str | None = None) -> list[Schedule]:
    """The schedule types ``sampler`` (an A1111 sampler name) follows on a model whose scheduler is
    ``own_class``; without a sampler, those at least one of the model's samplers follows."""
    if own_class == FLOW_EULER:
        return [AUTOMATIC]
    samplers = sampler_names(own_class) if sampler is None else [sampler]
    return [s for s in SCHEDULES if any(_takes(SAMPLERS[name][0], s) for name in samplers)]


def split_sampler(name: str, scheduler: str | None, own_class: str) -> tuple[str, Schedule]:
    """(A1111 sampler name, schedule type) as A1111 reads a request: ``name`` is a sampler's name or
    alias, perhaps followed by a schedule type's label, name or alias ("DPM++ 2M Karras"), which wins
    over ``scheduler`` (a schedule type's name or label; None or "" is automatic). Raises MemfitError
    naming the samplers and schedule types a model whose scheduler is ``own_class`` takes."""
    for schedule in SCHEDULES:
        for spelling in schedule.spellings():
            sampler = _sampler(name[:-len(spelling) - 1]) if name.endswith(" " + spelling) else None
            if sampler is not None:
                return sampler, schedule
    sampler = _sampler(name)
    if sampler is None:
        raise MemfitError(f"The sampler {name!r} has no diffusers equivalent; use one of: "
                          f"{', '.join(sampler_names(own_class)) or 'none (leave it out)'}.")
    if not scheduler:
        return sampler, AUTOMATIC
    schedule = next((s for s in SCHEDULES if scheduler in s.spellings()), None)
    if schedule is None:
        known = schedules_for(own_class)
        raise MemfitError(f"The scheduler {scheduler!r} is not a schedule type memfit can follow; use one of: "
                          f"{', '.join(s.name for s in known)} (or their labels: {', '.join(s.label for s in known)}).")
    return sampler, schedule


def _sampler(spelling: str) -> str | None:
    """The A1111 sampler named or aliased ``spelling``, or None."""
    return next((name for name, (_, _, aliases) in SAMPLERS.items() if spelling == name or spelling in aliases), None)


def sampler_label(sampler: str, schedule: Schedule) -> str:
    """The one name for a sampler and schedule type ("DPM++ 2M Karras"; "Euler a" when automatic):
    what runs record and memfit generate --sampler takes."""
    return sampler if schedule is AUTOMATIC else f"{sampler} {schedule.label}"


def resolve_sampler(name: str, own_class: str) -> tuple[str, dict[str, Any]]:
    """(scheduler class, config overrides) for the A1111 sampler ``name`` (with its schedule type, if
    any) on a model whose own scheduler is ``own_class``; raises MemfitError naming what works."""
    sampler, schedule = split_sampler(name, None, own_class)
    workable = sampler_names(own_class)
    if sampler not in workable:
        raise MemfitError(f"The sampler {sampler!r} does not fit this model's {own_class}; use one of: "
                          f"{', '.join(workable) or 'none (leave it out)'}.")
    fitting = schedules_for(own_class, sampler)
    if schedule not in fitting:
        missing = schedule.missing()
        why = f" without {missing} (pip install {missing})" if missing else " on this model"
        raise MemfitError(f"The sampler {sampler!r} cannot follow the {schedule.label} schedule type{why}; "
                          f"use one of: {', '.join(s.label for s in fitting)}.")
    if own_class == FLOW_EULER:
        return FLOW_EULER, {}
    cls, overrides, _ = SAMPLERS[sampler]
    return cls, {**overrides, **schedule.overrides}


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
