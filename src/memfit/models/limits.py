"""The limits of a run's settings that need no model to check: steps, guidance, seed and the largest side.

An adapter checks the settings it resolves (the model's defaults filled in, memfit.models.families.base);
the CLI checks what the user typed before it imports torch and opens the model, so a typo is refused at
once instead of after seconds of imports. One definition, so both say the same sentence.
"""

from __future__ import annotations

import math

from memfit.errors import MemfitError

__all__ = ["MAX_SIDE", "MAX_STEPS", "check_settings"]

# Upper limits that catch typos before they reach an allocator (--width 1000000 would ask for terabytes).
MAX_SIDE = 16384
MAX_STEPS = 10000


def check_settings(*, steps: int | None = None, guidance: float | None = None, seed: int | None = None) -> None:
    """Refuse ``steps``, ``guidance`` or ``seed`` outside what a run takes; None is not checked (the model's
    default fills it in later)."""
    if steps is not None:
        if steps < 1:
            raise MemfitError(f"--steps must be at least 1, got {steps}.")
        if steps > MAX_STEPS:
            raise MemfitError(f"--steps {steps} is more than memfit takes ({MAX_STEPS}); use fewer steps.")
    if guidance is not None and not math.isfinite(guidance):
        raise MemfitError(f"--guidance {guidance} is not a finite number; use a scale such as 1 (off) or 7.5.")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise MemfitError(f"--seed {seed} is outside the range torch's generator takes (0 to 2**64 - 1).")
