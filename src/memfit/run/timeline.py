"""A memory timeline of a run: every weight movement and the process's memory, sampled.

Users debugging "why is it slow / why did it die" need to see when which block was read from
which tier, and how memory moved against the plan. While a run is recorded (``Timeline.record``,
one at a time per process), the executor's swap hooks report each block they bring in
(``record_move``: block, from tier, to tier, bytes, start and end), the runner marks stage
boundaries with each stage's planned peak, and a background thread samples memory every
``interval`` seconds: RSS and, when the process has a memory cgroup limit, the cgroup's working set
on the CPU; allocated and reserved memory on a GPU.

The same sampler is the CPU's out-of-memory watch: the kernel kills a process over its cgroup limit
instead of raising, so when what the kernel cannot reclaim (the cgroup's working set less its active
file cache: a run streaming weights from a memory map keeps that cache near the limit, and the kernel
drops it rather than kill) passes ``WARN_FRACTION`` of the limit, memfit writes one warning to stderr
at once (a kill leaves no chance later) and keeps it for the report.

``write(path)``: ``.json`` writes the events; ``.png`` plots memory over time with stage boundaries,
planned peaks and the weight movements (drawn with Pillow, so no extra dependency).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


from memfit.devices import runtime_for
from memfit.errors import MemfitError
from memfit.plan.budget import CgroupUsage, own_cgroup_usage
from memfit.run.memory import current_rss
from memfit.sizes import format_bytes

__all__ = ["BUDGET_COLOUR", "Move", "Sample", "StageSpan", "Timeline", "WARN_FRACTION", "record_move"]

WARN_FRACTION = 0.92  # of the cgroup limit: past this the kernel's reclaim is struggling, a kill is near
BUDGET_COLOUR = (200, 0, 200)  # each stage's budget in the plot

_active: "Timeline | None" = None
_active_lock = threading.Lock()


@dataclass
class Move:
    block: str
    from_tier: str
    to_tier: str
    bytes: int
    start: float
    end: float
    stage: str


@dataclass
class Sample:
    t: float
    rss: int | None = None  # CPU: resident set of this process
    cgroup: int | None = None  # CPU: working set of this process's memory cgroup (when it has a limit)
    allocated: int | None = None  # GPU
    reserved: int | None = None  # GPU


@dataclass
class StageSpan:
    stage: str
    start: float
    end: float | None = None
    planned_peak: int | None = None
    budget: int | None = None


@dataclass
class Timeline:
    """Events of one run; times are seconds since the timeline started."""

    device: object = "cpu"  # a device name or a memfit.devices.DeviceRuntime
    interval: float = 0.05
    moves: list[Move] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    stages: list[StageSpan] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cgroup_limit: int | None = None
    # Where the cgroup reading comes from; tests point it at a fake.
    read_cgroup: Callable[[], CgroupUsage | None] = field(default=own_cgroup_usage, repr=False)

    def __post_init__(self) -> None:
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._warned_stage: str | None = None

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # --- recording ------------------------------------------------------------------------------

    def __enter__(self) -> "Timeline":
        global _active
        with _active_lock:
            _active = self
        self.sample()
        self._thread = threading.Thread(target=self._sample_loop, name="memfit-timeline", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        global _active
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        with _active_lock:
            if _active is self:
                _active = None

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> Sample:
        point = Sample(self.now())
        runtime = runtime_for(self.device)
        if runtime.separate_memory:
            point.allocated = runtime.memory_allocated()
            point.reserved = runtime.memory_reserved()
        else:
            point.rss = current_rss()
            usage = self.read_cgroup()
            if usage is not None:
                point.cgroup, self.cgroup_limit = usage.working_set, usage.limit
                self._watch(usage.working_set - usage.active_file, usage.limit)
        with self._lock:
            self.samples.append(point)
        return point

    def _watch(self, used: int, limit: int) -> None:
        stage = self.stages[-1].stage if self.stages else "start"
        if used < WARN_FRACTION * limit or self._warned_stage == stage:
            return
        self._warned_stage = stage
        message = (f"memfit: during {stage}, memory the kernel cannot reclaim, {format_bytes(used)}, is {used / limit:.0%} "
                   f"of this container's limit of {format_bytes(limit)}; the kernel may kill the run. If it does, give "
                   "a smaller --budget "
                   "(the plan then streams more weights), a smaller size, or a narrower dtype.")
        self.warnings.append(message)
        print(message, file=sys.stderr, flush=True)

    def stage_started(self, stage: str, budget: int | None) -> None:
        with self._lock:
            self.stages.append(StageSpan(stage, self.now(), budget=budget))

    def stage_ended(self, planned_peak: int | None) -> None:
        with self._lock:
            if self.stages:
                self.stages[-1].end = self.now()
                self.stages[-1].planned_peak = planned_peak

    def move(self, block: str, from_tier: str, to_tier: str, nbytes: int, start: float, end: float) -> None:
        with self._lock:
            stage = self.stages[-1].stage if self.stages else ""
            self.moves.append(Move(block, from_tier, to_tier, nbytes, start - self._t0, end - self._t0, stage))

    # --- output ---------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        with self._lock:
            return {
                "device": str(getattr(self.device, "name", self.device)),
                "interval_s": self.interval,
                "cgroup_limit": self.cgroup_limit,
                "stages": [asdict(s) for s in self.stages],
                "moves": [asdict(m) for m in self.moves],
                "samples": [asdict(s) for s in self.samples],
                "warnings": list(self.warnings),
            }

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        elif suffix == ".png":
            self._plot(path)
        else:
            raise MemfitError(f"--timeline {path} should end in .json (the events) or .png (a plot).")
        return path

    def _plot(self, path: Path) -> None:
        """Memory over time (one line per series), stage boundaries (grey), each stage's budget (magenta)
        and planned peak (red dashes), the cgroup limit (black), and weight movements as ticks along the bottom
        (orange from disk, blue from host). Drawn with Pillow, which memfit needs anyway for PNGs."""
        from PIL import Image, ImageDraw

        data = self.to_dict()
        width, height, left, right, top, bottom = 1000, 520, 70, 20, 20, 80
        image = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(image)
        series = {key: [(s["t"], s[key]) for s in data["samples"] if s[key] is not None]
                  for key in ("rss", "cgroup", "allocated", "reserved")}
        series = {key: points for key, points in series.items() if points}
        values = [v for points in series.values() for _, v in points]
        values += [s[key] for s in data["stages"] for key in ("planned_peak", "budget") if s[key] is not None]
        values += [data["cgroup_limit"]] if data["cgroup_limit"] else []
        t_end = max([self.now() if not data["samples"] else data["samples"][-1]["t"], 1e-3])
        y_max = max(values + [1]) * 1.08
        plot_h = height - top - bottom

        def x(t):
            return left + (width - left - right) * t / t_end

        def y(v):
            return top + plot_h * (1 - v / y_max)

        draw.rectangle([left, top, width - right, height - bottom], outline="black")
        for i in range(6):  # y axis: GiB
            v = y_max * i / 5
            draw.text((4, y(v) - 6), f"{v / 2**30:.2f} GiB", fill="black")
        for i in range(6):  # x axis: seconds
            t = t_end * i / 5
            draw.text((x(t) - 10, height - bottom + 4), f"{t:.1f}s", fill="black")
        for i, span in enumerate(data["stages"]):
            draw.line([x(span["start"]), top, x(span["start"]), height - bottom], fill=(160, 160, 160))
            draw.text((x(span["start"]) + 3, top + 3 + 12 * (i % 4)), span["stage"], fill=(90, 90, 90))
            end = span["end"] if span["end"] is not None else t_end
            if span["budget"] is not None:
                draw.line([x(span["start"]), y(span["budget"]), x(end), y(span["budget"])], fill=BUDGET_COLOUR, width=2)
            if span["planned_peak"] is not None:
                for a in range(int(x(span["start"])), int(x(end)), 8):
                    draw.line([a, y(span["planned_peak"]), min(a + 4, x(end)), y(span["planned_peak"])], fill="red")
        if data["cgroup_limit"]:
            draw.line([left, y(data["cgroup_limit"]), width - right, y(data["cgroup_limit"])], fill="black")
        colours = {"rss": (31, 119, 180), "cgroup": (44, 160, 44), "allocated": (31, 119, 180), "reserved": (148, 103, 189)}
        for key, points in series.items():
            if len(points) > 1:
                draw.line([(x(t), y(v)) for t, v in points], fill=colours[key], width=2)
        legend = [(name, colours[name]) for name in series] + [("planned peak", (255, 0, 0))]
        legend += [("budget", BUDGET_COLOUR)] if any(s["budget"] is not None for s in data["stages"]) else []
        legend += [("cgroup limit", (0, 0, 0))] if data["cgroup_limit"] else []
        for i, (name, colour) in enumerate(legend):
            draw.text((left + 10 + 130 * i, height - 30), name, fill=colour)
        lane = height - bottom + 22
        for move in data["moves"]:
            colour = (255, 127, 14) if move["from_tier"] == "disk" else (31, 119, 180)
            draw.line([x(move["start"]), lane, max(x(move["end"]), x(move["start"]) + 1), lane], fill=colour, width=6)
        draw.text((4, lane - 6), "moves", fill="black")
        image.save(path)


def record_move(block: str, from_tier: str, to_tier: str, nbytes: int, start: float, end: float) -> None:
    """Called by the swap hooks (times from time.perf_counter()); a no-op when no run is recorded."""
    timeline = _active
    if timeline is not None:
        timeline.move(block, from_tier, to_tier, nbytes, start, end)
