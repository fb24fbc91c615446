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

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.stages), default=0)

    def table(self) -> str:
        memory = "peak device memory" if self.device.startswith("cuda") else "peak RSS"
        planned = any(s.planned_peak_bytes is not None for s in self.stages)
        header = ("stage", "components resident", "wall s", memory, "weights") + (("planned peak", "strategy") if planned else ())
        rows = []
        for s in self.stages:
            row = (s.stage, ", ".join(s.components) or ("-" if not s.note else f"- ({s.note})"), f"{s.seconds:.2f}",
                   format_bytes(s.peak_bytes), format_bytes(s.weights_bytes))
            if planned:
                row += ("-" if s.planned_peak_bytes is None else format_bytes(s.planned_peak_bytes), s.strategy or "-")
            rows.append(row)
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.budget:
            lines.append(f"budget: {self.budget['source']}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["peak_bytes"] = self.peak_bytes
        return data

    def write_json(self, path: str | Path) -> None:
        from memfit.atomic import write_atomically

        text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_atomically(path, lambda tmp: Path(tmp).write_text(text))
