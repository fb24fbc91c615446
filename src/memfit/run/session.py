"""A warm session: stage pipelines loaded, fitted and compiled once, reused by every later run.

memfit.generate loads each stage's components, runs them and releases them, so one image never
holds more than its largest stage. A process that makes many images (``memfit batch``, a server)
would pay the load, the plan and the compile again for every image. Given a WarmSession, the
runner (memfit.run.runner.StageContext.load) keeps what a stage loaded and hands the same fitted
objects to the next run that asks for the same components under the same run options, so the
stage logic stays the runner's and only the loading is skipped.

Under a budget, a stage is fitted with the memory already in use, warm stages included, so the
plan still bounds the process. If a stage cannot be planned while other stages stay warm, the
runner drops them (``drop_all``) and plans again with the room that frees: the run then degrades to
loading that stage per image rather than failing.

What decides reuse (``key``): the folder, the components, the activation rules planned with, the
report label, the run dtype, device, budget and backend, and, under a budget, the sizes the
activation estimates depend on (width, height, frames, guidance batch). A key that changes
replaces the entry for the same components, so two fits of one stage are never held at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["WarmSession", "WarmStage"]


@dataclass
class WarmStage:
    """One kept stage pipeline and what its fit decided (replayed into each report)."""

    key: tuple
    pipe: Any
    names: list[str]
    strategy: str
    planned_peak: int | None
    runs: int = 0


class WarmSession:
    """Stage pipelines kept between runs; pass it to memfit.generate(session=...) or a StageRunner."""

    def __init__(self) -> None:
        self._stages: dict[tuple, WarmStage] = {}  # slot (folder, components, plan_as, label) -> entry

    @staticmethod
    def key(folder, names, plan_as: str, label: str, runner) -> tuple[tuple, tuple]:
        """(slot, key): the slot holds at most one fit of these components; the key says whether it can be reused."""
        slot = (str(folder.path), tuple(names), plan_as, label)
        sizes = ()
        if runner.budget is not None:
            s = runner.settings
            sizes = (s.width, s.height, s.num_frames, bool(runner.guided))
        key = slot + (runner.dtype, str(runner.device), repr(runner.budget), repr(runner.backend), runner.fallback,
                      sizes)
        return slot, key

    def get(self, slot: tuple, key: tuple) -> WarmStage | None:
        entry = self._stages.get(slot)
        if entry is None:
            return None
        if entry.key != key:
            del self._stages[slot]  # another fit of the same components: never hold two
            return None
        entry.runs += 1
        return entry

    def keep(self, slot: tuple, entry: WarmStage) -> None:
        self._stages[slot] = entry

    def drop_all(self) -> int:
        """Release every kept pipeline (the caller collects garbage); returns how many were dropped."""
        count = len(self._stages)
        self._stages.clear()
        return count

    def __len__(self) -> int:
        return len(self._stages)
