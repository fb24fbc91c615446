"""The one stage runner: every run memfit makes is a list of stages carried out here.

A stage loads its components from a model folder, fits them to the budget (always, when there is
one: memfit.run.fit), runs its work, and releases everything before the next stage loads, so peak
memory is the largest stage rather than the sum of all components. Text-to-image generation is
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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memfit.compile.entry_points import report_records, served_by_own_weights
from memfit.errors import MemfitError
from memfit.models.families import Settings
from memfit.models.folder import ModelFolder
from memfit.plan.budget import ABOVE_PROCESS, AUTO, Budget, StageDoesNotFit, resolve_budget, stage_start_budget
from memfit.run.fit import StageFit, fit_stage
from memfit.run.memory import PeakMemory, freeze_the_run_set_up, heap_holes, release_freed_memory
from memfit.run.options import RunOptions
from memfit.run.report import RunReport, StageReport
from memfit.run.threads import choose_threads, torch_threads
from memfit.run.timeline import Timeline
from memfit.run.watched_files import WatchedFiles
from memfit.sizes import format_bytes

__all__ = ["OOM_SHRINK", "Stage", "StageContext", "StageRunner", "out_of_memory_message", "resident_bytes"]

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


def out_of_memory_message(exc: BaseException, where: str) -> str:
    """One sentence for a device out-of-memory error raised ``where`` (outside a stage's re-planning)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
    return (f"The device ran out of memory {where} ({first}); give a smaller --budget (or leave it out for auto), "
            "a smaller size or a narrower --dtype, or free the device (another process may be using it).")


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
        self.note = ""
        self.components: list[str] = []
        self.compiled: list = []  # the compile records of every load
        self.fits: list[StageFit] = []  # what fitting each load of the stage decided
        # What fitting decided for the pipelines taken back from the pool (warm): they run as it planned
        self.kept_fits: list[StageFit] = []
        self.loaded_any = False  # whether a load fitted a pipeline rather than taking a kept one
        self._loaded: list[tuple[Any, list[str], tuple, tuple, StageFit | None]] = []

    @property
    def _planned(self) -> StageFit | None:
        """The last planned load's fit, or the kept pipeline's (None where nothing was planned)."""
        return next((fit for fit in reversed([*self.kept_fits, *self.fits]) if fit.strategy), None)

    @property
    def strategy(self) -> str:
        """How the stage holds its activations: the planned strategy ("" where none was planned)."""
        return self._planned.strategy if self._planned is not None else ""

    @property
    def heap_temporaries(self) -> bool:
        """Whether the plan counted the heap its temporaries come from (StageFit.heap_temporaries)."""
        return self._planned is not None and self._planned.heap_temporaries

    @property
    def planned_peak(self) -> int | None:
        peaks = [fit.planned_peak for fit in self.fits if fit.planned_peak is not None]
        return max(peaks) if peaks else None

    @property
    def streamed_bytes(self) -> int:
        """Weights the stage's plans left off the device (streamed)."""
        return sum(fit.streamed_bytes for fit in self.fits)

    @property
    def tiers(self) -> dict[str, dict[str, int]]:
        """Per planned component, its weights' bytes by tier, over every load of the stage."""
        tiers: dict[str, dict[str, int]] = {}
        for fit in self.fits:
            for component, by_tier in fit.tiers.items():
                totals = tiers.setdefault(component, {})
                for tier, size in by_tier.items():
                    totals[tier] = totals.get(tier, 0) + size
        return tiers

    def load(self, folder: ModelFolder, names, *, plan_as: str | None = None, shared: Mapping[str, Any] | None = None,
             label: str = "", pipeline_class: str | None = None, external: Mapping[str, Any] | None = None,
             loras=()):
        """The pipeline of ``folder`` with only ``names`` loaded, fitted to the budget and compiled.

        ``plan_as`` names the activation rules to plan with (default: this stage's name).
        ``shared`` maps component names to live modules another load of this run already fitted
        and compiled (same content): they are reused, not loaded again. ``label`` prefixes the
        component names in the report (e.g. "refiner.").
        ``pipeline_class`` loads the components as another pipeline class of the family (img2img,
        inpaint, ControlNet); ``external`` maps a component name to its own model folder (a ControlNet),
        planned with the rest of the stage. ``loras`` ((file, scale) pairs) are loaded into the loaded
        components before fitting (memfit.models.lora).
        With the run's pool (memfit.run.options.StagePool) a pipeline kept from an earlier run for
        the same slot and made for the same task and sizes is taken back instead of loaded; if kept
        stages leave this one too little room (it would stream weights, or not fit at all), the pool
        lets them all go and the stage is planned again as in a one-shot run.
        """
        runner = self.runner
        options = runner.options
        shared = dict(shared or {})
        external = dict(external or {})
        present = [name for name in names if name in folder.components or name in external]
        to_load = [name for name in present if name not in shared]
        key = (str(folder.path), tuple(to_load), tuple(sorted(shared)), plan_as or self.stage, label)
        made_for = self._made_for(pipeline_class, external, loras)
        pool = options.pool
        pipe, fit = pool.take(key, made_for) if pool is not None else (None, None)
        limit = None if self.budget is None else self.budget.device
        if pipe is not None:
            self.note = "warm" if not self.note else f"{self.note}, warm"
            if fit is not None:
                self.kept_fits.append(fit)
            pool.make_room(self.stage, options.runtime.memory_in_use(), limit)
        else:
            self.loaded_any = True
            if pool is not None and limit is not None:
                pool.free_buffers()
            task = (pipeline_class, external, loras)
            note = self.note
            try:
                pipe, fit = self._load_fitted(folder, to_load, shared, plan_as, *task)
                streamed = self.streamed_bytes + fit.streamed_bytes
                crowded = "" if not streamed else \
                    f"streams {format_bytes(streamed)} of weights with the other stages kept loaded"
            except StageDoesNotFit:
                if pool is None or not pool.holds_any():
                    raise
                crowded = "does not fit the budget with the other stages kept loaded"
            if pool is not None and crowded and pool.holds_any():
                # Warm stages took the room this one needed: give it back and plan this stage as a
                # one-shot run would; from now on the pool keeps nothing (StagePool.give_up). This
                # stage's first fit goes too, and nothing of it reaches the report.
                pool.give_up(f"{self.stage} {crowded}")
                runner.report.notes.append(f"{self.stage}: planned again after releasing the warm stages "
                                           f"(it {crowded})")
                pipe = fit = None
                release_freed_memory()
                self.note = note
                pipe, fit = self._load_fitted(folder, to_load, shared, plan_as, *task)
            elif pool is not None and self.streamed_bytes + fit.streamed_bytes:
                pool.give_up(f"{self.stage} streams {format_bytes(self.streamed_bytes + fit.streamed_bytes)} "
                             "of weights even alone")
            self.fits.append(fit)
            self.compiled += fit.compiled
            runner.report.notes += fit.notes
        if shared:
            pipe.register_modules(**shared)  # objects loaded (and compiled) once for the whole run
        runner.files.add(path for name in to_load for path in folder.weight_files(name))
        watch_steps(pipe, self.stage, runner.on_step)
        pipe.set_progress_bar_config(disable=not options.progress, desc=self.stage, leave=False)
        self.components += [label + name for name in to_load]
        self._loaded.append((pipe, to_load, key, made_for, fit))
        if runner._peak is not None:
            runner._peak.loaded()  # the stage's device peaks from here on are its run's, not its load's
        return pipe

    def _made_for(self, pipeline_class: str | None, external: Mapping[str, Any], loras) -> tuple:
        """What a loaded pipeline was made for beyond its components: a warm one is reused only for the
        same (its task's class, external folders, LoRAs and, under a budget, the sizes it was planned for)."""
        settings, sizes = self.runner.settings, ()
        if self.runner.budget is not None:
            sizes = (settings.width, settings.height, settings.num_frames, bool(self.runner.guided))
        return (pipeline_class, tuple(sorted((name, str(path)) for name, path in external.items())),
                tuple((str(path), float(scale)) for path, scale in loras), sizes)

    def _load_fitted(self, folder: ModelFolder, to_load: list[str], shared: dict, plan_as: str | None,
                     pipeline_class: str | None, external: dict, loras) -> tuple[Any, StageFit]:
        runner = self.runner
        options = runner.options
        runtime = options.runtime
        # On the CPU also the holes earlier loops left in the heap: a stage's allocations may take them back.
        already_used = runtime.memory_in_use() + (0 if runtime.separate_memory else heap_holes())
        task_options = {key: value for key, value in (("pipeline_class", pipeline_class), ("external", external))
                        if value}  # only where a task needs them: text to image loads as before
        # Loaded on the host (device None) and planned there: only what the plan keeps on the device
        # moves to it (memfit.run.executor.optimize), so a stage larger than a GPU can still run.
        # Weights stored in another dtype than the run's load as views of their files and are converted
        # block by block once planned (streamed ones at each forward): the whole model is never
        # converted at once. Only where the plan is carried out on the CPU, with nothing else changing
        # the loaded weights first (a LoRA, a compiler).
        # A component that a compiled model with its own copy of the weights will serve loads in its files'
        # dtype too: its torch weights are only read by a cold compile or an eager fallback, which convert
        # what they read (memfit.compile.weights), so a warm store never pays for converting them.
        converting = []
        if runtime.can_stream and not runtime.separate_memory and not loras:
            candidates = [name for name in to_load if name not in external]
            if options.backend is not None:
                candidates = list(served_by_own_weights(folder.components, candidates, options.backend))
            if options.backend is not None or self.budget is not None:
                converting = [name for name in candidates if folder.convertible(name, options.torch_dtype)]
        pipe = folder.load_stage(to_load, options.torch_dtype, None, in_file_dtype=converting, **task_options)
        if loras:
            from memfit.models.lora import load_loras

            if load_loras(pipe, loras, folder.configs):
                self.note = (self.note + "; " if self.note else "") + f"{len(loras)} LoRA(s), unfused"
        fit = fit_stage(pipe, folder, to_load, options, stage=self.stage, plan_as=plan_as or self.stage,
                        budget=self.budget, already_used=already_used, converting=converting,
                        settings=runner.settings, guided=runner.guided, auto_budget=runner.resolved.mode == AUTO,
                        shared=shared)
        return pipe, fit

    def _release(self) -> int:
        """Drop every pipeline this stage loaded (or hand it to the run's pool, which may keep it
        loaded for the next run); returns the weight bytes they held."""
        weights = sum(resident_bytes(pipe, names) for pipe, names, *_ in self._loaded)
        for pipe, *_ in self._loaded:
            vars(pipe).pop("progress_bar", None)  # watch_steps' closure would keep this run's runner alive
        pool = self.runner.options.pool
        if pool is not None:
            for pipe, _, key, made_for, fit in self._loaded:
                # With its compiled models' buffers: the pool frees them when a stage needs the room.
                pool.keep(key, made_for, pipe, fit)
        self._loaded.clear()
        return weights


class StageRunner:
    """Carries out a list of stages with one run's options; every stage lands in ``report``."""

    def __init__(self, options: RunOptions, *, report: RunReport, settings: Settings, guided: bool):
        self.options = options
        self.report = report
        self.settings = settings
        self.guided = guided
        self.runtime = options.runtime
        self.device = self.runtime.device  # where torch places the run's tensors
        # Resolved now, before any weight loads: the process's own memory is part of the budget.
        self.resolved = resolve_budget(options.budget, self.runtime, in_use=self.runtime.memory_in_use())
        self.budget = self.resolved.budget
        report.budget = self.resolved.to_dict()
        self.timeline = Timeline(device=self.runtime)
        self._peak: PeakMemory | None = None  # the running stage's, while one runs
        self.files = WatchedFiles()  # the weight files the stages loaded, checked before each stage and step

    def on_step(self, stage: str, done: int, total: int) -> None:
        """Between denoising steps (and before each stage): the caller's ``on_step``, then the files unchanged,
        as near the next step's start as can be."""
        if self.options.on_step is not None:
            self.options.on_step(stage, done, total)
        self.files.check()

    def run(self, stages: list[Stage]) -> dict[str, Any]:
        """Run ``stages`` in order; returns each stage's result by name."""
        results: dict[str, Any] = {}
        freeze_the_run_set_up()
        threads = choose_threads(self.options.threads)
        self.report.threads = threads.to_dict()
        with torch_threads(threads.count), self.timeline:
            for stage in stages:
                # A cancellation point before anything of the stage loads: a caller that wants the run
                # stopped (a server's client went away) need not wait through a stage's loading.
                self.on_step(stage.name, 0, 0)
                try:
                    results[stage.name] = self._run_stage(stage, results)
                except torch.OutOfMemoryError as exc:  # outside the stage's own retry (releasing, measuring)
                    message = out_of_memory_message(exc, f"in the {stage.name} stage")
                else:
                    continue
                self._release_device()  # out of the except block: its traceback holds the stage's tensors
                raise MemfitError(message)
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
        if self.options.pool is not None:
            self.options.pool.give_up(f"{stage.name} ran out of memory")  # kept stages hold memory the retry needs
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
        self.runtime.empty_cache()

    def _attempt(self, stage: Stage, results: dict[str, Any], budget: Budget | None):
        release_freed_memory()
        if budget is not None and self.resolved.mode == ABOVE_PROCESS:
            budget = stage_start_budget(budget, self.runtime.memory_in_use())  # what this stage adds, on top
        context = StageContext(self, stage.name, budget)
        self.timeline.stage_started(stage.name, None if budget is None else budget.device)
        with PeakMemory(self.runtime) as peak:
            self._peak = peak
            started = time.perf_counter()
            try:
                result = stage.work(context, results)
                weights = context._release()
            finally:
                self._peak = None
                context._release()  # after a failure too: a pool keeps pipes that a stopped run left intact
                self._release_device()  # the stage's pipelines are gone once its work returns
                self.timeline.stage_ended(context.planned_peak)
            seconds = time.perf_counter() - started
        self.report.stages.append(StageReport(
            stage.name, context.components, seconds, peak.peak_bytes, peak.start_bytes, weights, peak.method,
            note=context.note, planned_peak_bytes=context.planned_peak, strategy=str(context.strategy),
            tiers=context.tiers, device_memory=None if peak.device_peaks is None else peak.device_peaks.to_dict(),
        ))
        report_records(self.report, context.compiled)
        if self.options.pool is not None:
            self.options.pool.note_growth(stage.name, peak.peak_bytes - peak.start_bytes, loaded=context.loaded_any)
        return result


def watch_steps(pipe, stage: str, on_step: Callable[[str, int, int], None]) -> None:
    """Make ``pipe``'s own progress bar (every diffusers pipeline's denoising loop advances one) also
    call ``on_step(stage, steps done, total)``: progress reports and interrupts need no adapter code."""
    bar_of_class = type(pipe).progress_bar

    def progress_bar(iterable=None, total=None):
        bar = bar_of_class(pipe, iterable=iterable, total=total)
        return StepWatch(bar, stage, total if total is not None else len(iterable), on_step)

    pipe.progress_bar = progress_bar


class StepWatch:
    """A tqdm bar that also reports each update to ``on_step``."""

    def __init__(self, bar, stage: str, total: int, on_step):
        self.bar, self.stage, self.total, self.on_step, self.done = bar, stage, total, on_step, 0
        on_step(stage, 0, total)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def update(self, n: int = 1):
        self.bar.update(n)
        self.done += n
        self.on_step(self.stage, self.done, self.total)

    def __iter__(self):
        for item in self.bar:
            yield item
            self.done += 1
            self.on_step(self.stage, self.done, self.total)

    def __getattr__(self, name):
        return getattr(self.bar, name)


def _snapshot(results: dict[str, Any]) -> dict[str, Any]:
    """A copy of a stage's inputs two levels deep: stages pop what they consume (results["encode"]["base"])."""
    return {name: dict(value) if isinstance(value, dict) else value for name, value in results.items()}
