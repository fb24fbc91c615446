"""How long a request would hold the server's one worker (memfit serve --max-seconds).

The estimate is deliberately simple, and only of the denoising loop (encode, decode and loading are
not counted):

    seconds = images x denoising steps x pixels x (seconds per step / pixels of a measured run)

The measured runs are this checkpoint's earlier ones: each request's denoising loop gives its time per
step at its size (the latest run at each size is kept). A request is estimated from the measured size
nearest its own, and only from one with at least a quarter of its pixels: a step has costs that do not
grow with the image (the scheduler, each layer's fixed overhead) and attention grows faster than the
pixel count, so a rate taken from a much smaller image says little about a large one (a tiny first
request's rate is mostly fixed costs, and would refuse sizes that run in seconds). A request with no
such size measured is not refused before it
runs; its own loop measures it instead: after its second step, a job whose time per step so far says it
would pass the limit is stopped, with the same answer a refusal before queueing gets.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["Measured", "StepTimes", "check_seconds"]

# A request is estimated only from a measured size with at least 1/MAX_SCALE of its pixels.
MAX_SCALE = 4
KEEP_SIZES = 16  # measured sizes kept per checkpoint (the oldest go first)


@dataclass(frozen=True)
class Measured:
    """A denoising loop of ``width`` x ``height`` that took ``seconds_per_step`` per step."""

    width: int
    height: int
    seconds_per_step: float

    @property
    def pixels(self) -> int:
        return self.width * self.height


class StepTimes:
    """Per checkpoint, the denoising time per step measured at each size run so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._measured: dict[Path, dict[tuple[int, int], Measured]] = {}

    def record(self, checkpoint: Path, measured: Measured) -> None:
        with self._lock:
            sizes = self._measured.setdefault(checkpoint, {})
            sizes.pop((measured.width, measured.height), None)
            sizes[measured.width, measured.height] = measured
            while len(sizes) > KEEP_SIZES:
                del sizes[next(iter(sizes))]

    def nearest(self, checkpoint: Path, width: int, height: int) -> Measured | None:
        """The measured size nearest ``width`` x ``height`` (by pixel count) with at least 1/MAX_SCALE of its
        pixels, or None."""
        pixels = width * height
        with self._lock:
            usable = [m for m in self._measured.get(checkpoint, {}).values() if m.pixels * MAX_SCALE >= pixels]
        return min(usable, key=lambda m: abs(math.log(m.pixels / pixels)), default=None)


def check_seconds(measured: Measured, width: int, height: int, steps: int, images: int, limit: float | None,
                  multiple: int) -> float:
    """The seconds of denoising ``images`` images of ``width`` x ``height`` at ``steps`` steps would take, estimated
    from ``measured``; MemfitError if over ``limit``, naming the largest size (sides multiples of ``multiple``) and
    the most steps that would fit."""
    rate = measured.seconds_per_step / measured.pixels  # seconds per step and pixel
    seconds = images * steps * width * height * rate
    if limit is None or seconds <= limit:
        return seconds
    fits = _largest_size(width, height, limit / (images * steps * rate), multiple)
    most_steps = int(limit / (images * width * height * rate))
    ways = [f"at most {fits[0]}x{fits[1]} (the largest size of about this shape that fits)" if fits else
            "a smaller size"]
    if most_steps >= 1:
        ways.append(f"at most {most_steps} steps at {width}x{height}")
    if images > 1:
        ways.append("fewer images")
    many = f" x {images} images" if images > 1 else ""
    raise MemfitError(
        f"{width}x{height} at {steps} steps{many} would hold the server for about {seconds:.0f} s of denoising "
        f"(estimated from {measured.seconds_per_step:.3g} s per step at {measured.width}x{measured.height} on this "
        f"checkpoint, in proportion to pixels x steps), more than the {limit:g} s a request may take; ask for "
        f"{' or '.join(ways)} (memfit serve --max-seconds raises the limit).")


def _largest_size(width: int, height: int, pixels: float, multiple: int) -> tuple[int, int] | None:
    """The largest size of ``width`` x ``height``'s shape with at most ``pixels`` pixels, sides multiples of
    ``multiple``; a side that would fall below ``multiple`` stays there and the other gives way (None: none fits)."""
    scale = math.sqrt(pixels / (width * height))
    sides = [max(multiple, int(side * scale) // multiple * multiple) for side in (width, height)]
    longer = 0 if sides[0] >= sides[1] else 1
    sides[longer] = min(sides[longer], int(pixels / sides[1 - longer]) // multiple * multiple)
    return (sides[0], sides[1]) if sides[longer] >= multiple else None
