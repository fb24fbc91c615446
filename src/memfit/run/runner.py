"""The one stage runner: every run memfit makes is a list of stages carried out here.

A stage loads its components from a model folder, fits them to the budget (always, when there is
one), runs its work, and releases everything before the next stage loads, so peak memory is the
largest stage rather than the sum of all components. Text-to-image generation is
encode -> denoise -> decode; encode-only is [encode]; base + refiner is
encode -> denoise -> refine -> decode. A stage's work gets the components only through
``StageContext.load``, so no stage can skip fitting.

The budget is resolved once, at the start of the run (memfit.plan.budget.resolve_budget): "auto"
(the default) measures what this machine, container or GPU can spare, "none" turns planning off, a
size is taken as given (refused above the container's or device's total); the report says which.

Out of memory: a torch.OutOfMemoryError in a stage (a GPU's allocator raises it) re-plans that stage
under a smaller budget (OOM_SHRINK of it) and runs it again once, from the same inputs and random
state; the report says so. A second one is an error naming the stage and both budgets. On the CPU
the kernel kills instead of raising: the run's timeline (memfit.run.timeline) watches the cgroup's
usage against its limit and warns on stderr before a kill is likely.

Fitting a stage: the budget left once the process's own memory is counted is planned for the
stage's components together with the activations of each strategy the family allows
(memfit.plan.activations), and the first strategy that keeps every weight resident wins (else the
cheap one that keeps the most). On a CPU-only machine host RAM *is* the device, so what does not
fit stays memory-mapped from the model's own safetensors files (the disk tier), never a second copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memfit.compile.entry_points import compile_stage, report_records
from memfit.errors import MemfitError
from memfit.models.families import Settings
from memfit.models.folder import ModelFolder, parse_dtype
from memfit.plan.budget import AUTO, Budget, resolve_budget
from memfit.run.memory import PeakMemory, current_rss, release_freed_memory, return_large_frees_to_os
from memfit.run.report import RunReport, StageReport
from memfit.run.timeline import Timeline
from memfit.sizes import format_bytes

__all__ = ["OOM_SHRINK", "Stage", "StageContext", "StageRunner", "default_device", "memory_in_use", "resident_bytes"]

# After an out-of-memory error a stage is re-planned under this fraction of the budget it failed in.
OOM_SHRINK = 0.7


@dataclass(frozen=True)
class Stage:
    """One stage of a run: its name (encode, denoise, refine, decode) and its work.

    ``work(context, results)`` gets the stage context (load components through it) and the
    results of the stages before it, by stage name; what it returns is this stage's result.
    """

    name: str
    work: Callable[["StageContext", dict[str, Any]], Any]
    # The random generators the work draws from: restored to their state at the stage's start when
    # the stage is run again after running out of memory, so the retry computes the same result.
    generators: tuple = ()


def default_device() -> torch.device:
    """Where a run executes when the caller names no device: the GPU if there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def memory_in_use(device: torch.device) -> int:
    """What the process holds on the execution device right now: the baseline a stage's plan adds to."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return current_rss()


def resident_bytes(pipe, names) -> int:
    """Bytes of the parameters and buffers of the named components that are torch modules."""
    total = 0
    for name in names:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            total += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return total


class StageContext:
    """What a stage's work sees: ``load`` (fitted, compiled components), the strategy chosen for
    its activations, and a ``note`` for the report."""

    def __init__(self, runner: "StageRunner", stage: str, budget: Budget | None = None):
        self.runner = runner
        self.stage = stage
        self.budget = budget  # this stage's budget: the run's, or a smaller one after running out of memory
        self.strategy = ""
        self.planned_peak: int | None = None
        self.note = ""
        self.components: list[str] = []
        self.compiled: list = []
        self._loaded: list[tuple[Any, list[str]]] = []

    def load(self, folder: ModelFolder, names, *, plan_as: str | None = None, shared: Mapping[str, Any] | None = None,
             label: str = ""):
        """The pipeline of ``folder`` with only ``names`` loaded, fitted to the budget and compiled.

        ``plan_as`` names the activation rules to plan with (default: this stage's name).
        ``shared`` maps component names to live modules another load of this run already fitted
        and compiled (same content): they are reused, not loaded again. ``label`` prefixes the
        component names in the report (e.g. "refiner.").
        """
        runner = self.runner
        shared = dict(shared or {})
        present = [name for name in names if name in folder.components]
        to_load = [name for name in present if name not in shared]
        already_used = memory_in_use(runner.device)
        pipe = folder.load_stage(to_load, runner.torch_dtype, runner.device)
        if self.budget is not None and _has_weights(pipe, to_load):
            self._fit(pipe, folder, plan_as or self.stage, already_used)
        if shared:
            pipe.register_modules(**shared)  # objects loaded (and compiled) once for the whole run
        compile_stage(pipe, folder.path, runner.backend, runner.fallback, self.compiled, folder.component_fingerprint)
        pipe.set_progress_bar_config(disable=not runner.progress, desc=self.stage, leave=False)
        self.components += [label + name for name in to_load]
        self._loaded.append((pipe, to_load))
        return pipe

    def _fit(self, pipe, folder: ModelFolder, plan_as: str, already_used: int) -> None:
        from memfit.plan.activations import choose, stage_strategies
        from memfit.run.executor import blocks_not_run, optimize, plan_stage, reads_in_place

        runner = self.runner
        report = runner.report
        budget = self.budget
        if runner.device.type == "cpu":
            budget = Budget(device=budget.device, host=0, disk=str(folder.path))
        adapter = folder.adapter
        room = _room_left(budget, already_used)
        options = stage_strategies(adapter, plan_as, runner.settings, runner.guided, runner.dtype)
        parts = adapter.stage_parts.get(plan_as)
        try:
            strategy, plan = choose(options, lambda activations: plan_stage(pipe, room, self.stage, activations, parts))
        except MemfitError as exc:
            raise MemfitError(
                f"{exc} These figures leave out the {format_bytes(already_used)} this process already holds "
                "(Python, torch and the libraries loaded): add that to any budget named above."
            ) from exc
        optimize(pipe, plan=plan, model_dir=folder.path, device=runner.device, parts=parts)
        self.strategy = strategy.name
        if strategy.name == "banded":
            from memfit.run.banded_decode import enable_banded_decode

            enable_banded_decode(pipe.vae)
        unrun = blocks_not_run(pipe)
        if unrun:
            report.notes.append(
                f"{self.stage}: {format_bytes(sum(b.bytes for b in unrun))} of weights the stage does not run "
                f"({', '.join(sorted({b.component + '/' + b.name.split('.')[0] for b in unrun}))}) left memory-mapped "
                "on disk, outside the plan"
            )
        stage_plan = plan.stages[0]
        binds = strategy is not options[0] or stage_plan.streamed_from_host_bytes or stage_plan.streamed_from_disk_bytes
        if runner.resolved.mode != AUTO or binds:
            # Freed activations then leave RSS at once, so the stage stays within its plan. Not set
            # while an automatic budget holds everything: that run then costs nothing a plain one does not.
            return_large_frees_to_os()
        # The plan fits the read-ahead into the budget (a cgroup cap charges the page cache), but read in
        # place it is mapped into this process only once its block runs: the predicted peak RSS leaves it out.
        read_ahead = stage_plan.stream_window_bytes - stage_plan.largest_streamed_bytes if reads_in_place(pipe) else 0
        planned = already_used + stage_plan.peak_bytes - read_ahead
        self.planned_peak = planned if self.planned_peak is None else max(self.planned_peak, planned)
        if read_ahead:
            report.notes.append(f"{self.stage}: {format_bytes(read_ahead)} read ahead into the page cache, "
                                "outside this process's memory until its block runs")
        if strategy is not options[0]:
            report.notes.append(
                f"{self.stage}: {strategy.name} (activations {format_bytes(strategy.activation_bytes)} instead of "
                f"{format_bytes(options[0].activation_bytes)} for {options[0].name}), so more weights stay resident"
            )
        for planned_stage in plan.stages:
            report.notes.append(
                f"plan {planned_stage.name}: {format_bytes(planned_stage.resident_bytes)} resident, "
                f"{format_bytes(planned_stage.streamed_from_host_bytes)} streamed from host, "
                f"{format_bytes(planned_stage.streamed_from_disk_bytes)} streamed from disk (memory-mapped), "
                f"activations {format_bytes(planned_stage.activation_bytes)}"
            )

    def _release(self) -> int:
        """Drop every pipeline this stage loaded; returns the weight bytes they held."""
        weights = sum(resident_bytes(pipe, names) for pipe, names in self._loaded)
        self._loaded.clear()
        return weights


class StageRunner:
    """Carries out a list of stages with one set of run options; every stage lands in ``report``."""

    def __init__(self, *, report: RunReport, settings: Settings, guided: bool, dtype: str, device: torch.device,
                 budget="auto", backend=None, fallback: str | None = None, progress: bool = True):
        self.report = report
        self.settings = settings
        self.guided = guided
        self.dtype = dtype
        self.torch_dtype = parse_dtype(dtype)
        self.device = device
        # Resolved now, before any weight loads: the process's own memory is part of the budget.
        self.resolved = resolve_budget(budget, str(device) if device.type == "cuda" else "cpu",
                                       in_use=memory_in_use(device))
        self.budget = self.resolved.budget
        report.budget = self.resolved.to_dict()
        self.backend = backend
        self.fallback = fallback
        self.progress = progress
        self.timeline = Timeline(device=str(device))

    def run(self, stages: list[Stage]) -> dict[str, Any]:
        """Run ``stages`` in order; returns each stage's result by name."""
        results: dict[str, Any] = {}
        with self.timeline:
            for stage in stages:
                results[stage.name] = self._run_stage(stage, results)
        self.report.notes += self.timeline.warnings
        return results

    def _run_stage(self, stage: Stage, results: dict[str, Any]):
        inputs = _snapshot(results)
        states = [generator.get_state() for generator in stage.generators]
        failed = None
        try:
            return self._attempt(stage, results, self.budget)
        except torch.OutOfMemoryError as exc:
            failed = str(exc).splitlines()[0] if str(exc) else "out of memory"
        # Out of the except block: the traceback (and the stage's pipelines its frames hold) is gone.
        self._release_device()
        budget = self.budget
        if budget is None or budget.device is None:
            raise MemfitError(
                f"The {stage.name} stage ran out of memory with no budget ({failed}). Leave --budget out (auto) "
                "or give a size, so memfit plans the stage to fit the memory there is."
            )
        smaller = Budget(device=int(budget.device * OOM_SHRINK), host=budget.host, disk=budget.disk)
        self.report.notes.append(
            f"{stage.name}: out of memory under a budget of {format_bytes(budget.device)} ({failed}); re-planned under "
            f"{format_bytes(smaller.device)} and run again"
        )
        results.clear()
        results.update(_snapshot(inputs))
        for generator, state in zip(stage.generators, states):
            generator.set_state(state)
        try:
            return self._attempt(stage, results, smaller)
        except torch.OutOfMemoryError as exc:
            failed = str(exc).splitlines()[0] if str(exc) else "out of memory"
        self._release_device()
        raise MemfitError(
            f"The {stage.name} stage ran out of memory twice: under a budget of {format_bytes(budget.device)} and again "
            f"re-planned under {format_bytes(smaller.device)} ({failed}). Something outside memfit's plan holds memory "
            "(another process on the device, activations above the estimate): give a smaller --budget, a smaller "
            "size or a narrower --dtype, or free the device."
        )

    def _release_device(self) -> None:
        release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _attempt(self, stage: Stage, results: dict[str, Any], budget: Budget | None):
        context = StageContext(self, stage.name, budget)
        release_freed_memory()
        self.timeline.stage_started(stage.name, None if budget is None else budget.device)
        with PeakMemory(self.device) as peak:
            started = time.perf_counter()
            try:
                result = stage.work(context, results)
                weights = context._release()
            finally:
                context._loaded.clear()
                self._release_device()  # the stage's pipelines are gone once its work returns
                self.timeline.stage_ended(context.planned_peak)
            seconds = time.perf_counter() - started
        self.report.stages.append(StageReport(
            stage.name, context.components, seconds, peak.peak_bytes, peak.start_bytes, weights, peak.method,
            note=context.note, planned_peak_bytes=context.planned_peak, strategy=context.strategy,
        ))
        report_records(self.report, context.compiled)
        return result


def _snapshot(results: dict[str, Any]) -> dict[str, Any]:
    """A copy of a stage's inputs two levels deep: stages pop what they consume (results["encode"]["base"])."""
    return {name: dict(value) if isinstance(value, dict) else value for name, value in results.items()}


def _has_weights(pipe, names) -> bool:
    return any(isinstance(getattr(pipe, name, None), torch.nn.Module) for name in names)


def _room_left(budget: Budget, already_used: int) -> Budget:
    """The budget left for a stage's weights and activations once the process's own memory is counted."""
    if budget.device is None:
        return budget
    if budget.device <= already_used:
        raise MemfitError(
            f"The budget of {format_bytes(budget.device)} is already used up by this process before any weight is "
            f"loaded ({format_bytes(already_used)}: Python, torch and the libraries memfit loaded). Give a budget "
            "above that, or leave it out (auto) to let memfit detect one."
        )
    return Budget(device=budget.device - already_used, host=budget.host, disk=budget.disk)
