"""The per-stage run report: what was resident, how long it took, how much memory it peaked at."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memfit.sizes import format_bytes


@dataclass
class StageReport:
    stage: str
    components: list[str]
    seconds: float
    peak_bytes: int
    start_bytes: int
    weights_bytes: int
    memory_method: str
    note: str = ""
    # One dict per compiled entry point (memfit.compile.entry_points.CompileRecord.to_dict()): component, entry,
    # backend asked for, backend_used, status (compiled / fallback / ...), reason, compile_seconds.
    compiled: list = field(default_factory=list)
    # Under a budget: the peak RSS the plan predicts (process memory at stage start + the stage plan's
    # resident weights, streaming window and activations; a window read in place from memory maps
    # counts only its running block, the rest is page cache) and the activation strategy it chose.
    planned_peak_bytes: int | None = None
    strategy: str = ""
    # Under a budget: per planned component, its weights' bytes by tier ("device": resident, "host" and
    # "disk": streamed from there), e.g. {"unet": {"device": 2**30, "disk": 2**31}}.
    tiers: dict = field(default_factory=dict)
    # On a device with memory of its own (a GPU): memfit.run.memory.DevicePeaks.to_dict() (peak allocated
    # and reserved memory while running and while loading, pinned host bytes, peak RSS, allocator
    # retries); None on the CPU, where peak_bytes is the peak RSS and says it all.
    device_memory: dict | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["device_memory"] is None:
            del data["device_memory"]  # a CPU report keeps the fields it always had
        return data


@dataclass
class RunReport:
    device: str
    dtype: str
    model: str
    stages: list[StageReport] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Where the run's budget came from (memfit.plan.budget.ResolvedBudget.to_dict): mode, source, budget.
    budget: dict = field(default_factory=dict)
    # The threads torch computed with and why (memfit.run.threads.ThreadCount.to_dict): count, source.
    threads: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.stages), default=0)

    def table(self) -> str:
        on_device = any(s.device_memory is not None for s in self.stages)
        memory = ("peak allocated", "peak reserved", "load peak", "pinned", "peak RSS") if on_device else ("peak RSS",)
        planned = any(s.planned_peak_bytes is not None for s in self.stages)
        header = ("stage", "components", "wall s", *memory, "weights") + (("planned peak", "strategy") if planned else ())
        rows = []
        for s in self.stages:
            row = (s.stage, _components_cell(s), f"{s.seconds:.2f}",
                   *_memory_cells(s, on_device), format_bytes(s.weights_bytes))
            if planned:
                row += ("-" if s.planned_peak_bytes is None else format_bytes(s.planned_peak_bytes), s.strategy or "-")
            rows.append(row)
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.budget:
            lines.append(f"budget: {self.budget['source']}")
        if self.threads:
            lines.append(f"threads: {self.threads['count']} ({self.threads['source']})")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["stages"] = [stage.to_dict() for stage in self.stages]
        data["peak_bytes"] = self.peak_bytes
        return data

    def write_json(self, path: str | Path) -> None:
        from memfit.atomic import write_atomically

        text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_atomically(path, lambda tmp: Path(tmp).write_text(text))


_TIER_WORDS = {"device": "resident", "host": "from host", "disk": "from disk"}


def _components_cell(stage: StageReport) -> str:
    """The stage's components; a planned one that streams says how many of its bytes are where, e.g.
    "unet (1.00 GiB resident, 2.00 GiB from disk)"."""
    if not stage.components:
        return "-" if not stage.note else f"- ({stage.note})"
    cells = []
    for label in stage.components:
        by_tier = stage.tiers.get(label.rpartition(".")[2], {})
        if any(by_tier.get(tier) for tier in ("host", "disk")):
            parts = ", ".join(f"{format_bytes(by_tier[tier])} {words}" for tier, words in _TIER_WORDS.items()
                              if by_tier.get(tier))
            label = f"{label} ({parts})"
        cells.append(label)
    return ", ".join(cells)


def _memory_cells(stage: StageReport, on_device: bool) -> tuple[str, ...]:
    if not on_device:
        return (format_bytes(stage.peak_bytes),)
    figures = stage.device_memory
    if figures is None:
        return ("-",) * 5
    load = figures["load_peak_allocated"]
    return (format_bytes(figures["peak_allocated"]), format_bytes(figures["peak_reserved"]),
            format_bytes(load) + " / " + format_bytes(figures["load_peak_reserved"]) if load else "-",
            format_bytes(figures["pinned_bytes"]), format_bytes(figures["peak_rss"]))
