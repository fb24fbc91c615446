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

from memfit.compile.entry_points import (compile_blocks, compile_stage, compiled_in_store, compiled_weight_bytes,
                                        report_records, served_by_own_weights)
from memfit.devices import DeviceRuntime, cuda_device_count, runtime_for
from memfit.dtypes import parse_dtype
from memfit.errors import MemfitError
from memfit.models.families import Settings
from memfit.models.folder import ModelFolder
from memfit.plan.budget import AUTO, Budget, resolve_budget
from memfit.run.memory import PeakMemory, current_rss, release_freed_memory, return_large_frees_to_os
from memfit.run.report import RunReport, StageReport
from memfit.run.timeline import Timeline
from memfit.sizes import format_bytes

__all__ = ["DEVICE_ACTIVATION_MARGIN", "OOM_SHRINK", "Stage", "StageContext", "StageDoesNotFit", "StageRunner",
           "check_budget_floor", "default_device", "memory_in_use", "out_of_memory_message", "place_whole",
           "resident_bytes", "resolve_device"]

# After an out-of-memory error a stage is re-planned under this fraction of the budget it failed in.
OOM_SHRINK = 0.7

# The activation estimates (memfit.plan.activations) are calibrated on CPU RSS. On a GPU the caching
# allocator rounds each block up (512 B, and 2 MiB segments for large ones) and keeps freed blocks
# that do not fit the next request, so the same tensors take more; this margin on the activations
# covers that. It is not measured on a GPU yet: the CUDA context and library workspaces are the
# detection reserve's (memfit.plan.budget.device_reserve), not this margin's.
DEVICE_ACTIVATION_MARGIN = 1.25

# Devices memfit places whole components on without streaming, and how to ask torch whether one is here.
_PLAIN_DEVICES = {
    "mps": lambda: torch.backends.mps.is_available(),
    "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
}


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


class StageDoesNotFit(MemfitError):
    """No plan fits a stage's components and activations into the budget left (StageContext._fit)."""


def default_device() -> torch.device:
    """Where a run executes when the caller names no device: the GPU if there is one."""
    return torch.device("cuda" if cuda_device_count() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a run executes on: ``device`` checked to exist on this machine, else the default."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise MemfitError(f"--device {device} is not a device torch knows; use cpu, cuda or cuda:N.") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type in _PLAIN_DEVICES:
        if not _PLAIN_DEVICES[resolved.type]():
            raise MemfitError(f"--device {device} names a {resolved.type} device but torch {torch.__version__} sees "
                              "none here; use --device cpu.")
        return resolved
    if resolved.type != "cuda":
        raise MemfitError(f"--device {device} is not supported by memfit; use cpu, cuda, cuda:N, mps or xpu.")
    count = cuda_device_count()
    if count == 0:
        raise MemfitError(f"--device {device} names a CUDA GPU but torch sees none here; use --device cpu.")
    if resolved.index is not None and resolved.index >= count:
        raise MemfitError(
            f"--device {device} does not exist: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}.")
    return resolved


def check_budget_floor(folder: ModelFolder, settings: Settings, dtype: str, budget, device: torch.device) -> None:
    """Refuse, before any stage runs, a budget below the smallest that can work for the whole run.

    Each stage's floor (its cheapest activation strategy with every block streamed) comes from the
    configs alone (memfit.plan.stages, meta-device sizing); the process's own memory is added. One
    message names the budget to give, instead of one stage's shortfall after another.
    """
    from memfit.plan.planner import minimum_device_bytes
    from memfit.plan.stages import stage_options

    limit = Budget.of(budget).device
    if limit is None:
        return
    try:
        options = stage_options(folder.adapter, dtype=dtype, width=settings.width, height=settings.height,
                                steps=settings.steps)
    except MemfitError:
        return  # a class the planner cannot size: each stage's own check still applies
    floors = {opts[0][1].name: min(minimum_device_bytes(stage) for _, stage in opts) for opts in options}
    worst = max(floors, key=floors.get)
    runtime = runtime_for(device)
    already = memory_in_use(runtime)
    if limit >= already + floors[worst]:
        return  # it may still fall short at a later stage, which then says so itself
    if not runtime.separate_memory:
        # What the process gains before the last stage starts (the pipeline's modules imported,
        # tokenizers, allocator pools): ~11% (40 MiB) on the tiny SD model. A GPU starts empty.
        # Counted in the budget this names, not in the refusal: only a budget that cannot work is refused.
        already += already // PROCESS_GROWTH_DIVISOR
    needed = already + floors[worst]
    raise MemfitError(
        f"The budget of {format_bytes(limit)} is below the smallest that can work for this run, about "
        f"{format_bytes(needed)} ({format_bytes(already)} for this process, Python, torch and the "
        f"libraries, plus {format_bytes(floors[worst])} for the {worst} stage with every weight streamed): "
        f"the smallest device budget that works is {needed} bytes; give --budget {_round_up_mib(needed)}MiB or more."
    )


PROCESS_GROWTH_DIVISOR = 8


def _round_up_mib(size: int) -> int:
    return -(-size // (1 << 20))


def memory_in_use(device: DeviceRuntime) -> int:
    """What the process holds on the execution device right now: the baseline a stage's plan adds to."""
    if device.separate_memory:
        # Allocated, not reserved: reserved also counts blocks the caching allocator keeps free, which
        # the stage's own tensors reuse; counted here they would be counted twice (once as the
        # baseline, once in the plan). Between stages the runner empties that cache anyway.
        return device.memory_allocated()
    return current_rss()


def place_whole(pipe, runtime: DeviceRuntime) -> None:
    """Move every torch module of ``pipe`` whole onto ``runtime``'s device: a stage with no plan (no budget,
    nothing to fit, or a device memfit cannot stream to) after loading on the host."""
    if not runtime.separate_memory:
        return  # on the CPU the host is the device
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for tensor in [*module.parameters(), *module.buffers()]:
                if not runtime.owns(tensor):
                    tensor.data = runtime.to_device(tensor.data)
    runtime.synchronize()


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
        self.strategy = ""
        self.planned_peak: int | None = None
        self.note = ""
        self.components: list[str] = []
        self.compiled: list = []
        self.streamed_bytes = 0  # weights the stage's plan left off the device (streamed)
        self.compiled_costs: dict[str, int] = {}  # compiled models of the load being fitted (memfit.compile)
        self.compiled_in_blocks: list[str] = []  # components of that load compiled block by block
        self.loaded_any = False  # whether a load fitted a pipeline rather than taking a kept one
        self._loaded: list[tuple[Any, list[str], tuple, tuple]] = []

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
        With the runner's pool (memfit.run.session.WarmPool) a pipeline kept from an earlier run for
        the same slot and made for the same task and sizes is taken back instead of loaded; if kept
        stages leave this one too little room (it would stream weights, or not fit at all), the pool
        lets them all go and the stage is planned again as in a one-shot run.
        """
        runner = self.runner
        shared = dict(shared or {})
        external = dict(external or {})
        present = [name for name in names if name in folder.components or name in external]
        to_load = [name for name in present if name not in shared]
        key = (str(folder.path), tuple(to_load), tuple(sorted(shared)), plan_as or self.stage, label)
        made_for = self._made_for(pipeline_class, external, loras)
        pool = runner.pool
        pipe = pool.take(key, made_for) if pool is not None else None
        limit = None if self.budget is None else self.budget.device
        if pipe is not None:
            self.note = "warm" if not self.note else f"{self.note}, warm"
            pool.make_room(self.stage, memory_in_use(runner.runtime), limit)
        else:
            self.loaded_any = True
            if pool is not None and limit is not None:
                pool.free_buffers()
            task = (pipeline_class, external, loras)
            note, compiled = self.note, len(self.compiled)
            try:
                pipe = self._load_fitted(folder, to_load, shared, plan_as, *task)
                crowded = "" if not self.streamed_bytes else \
                    f"streams {format_bytes(self.streamed_bytes)} of weights with the other stages kept loaded"
            except StageDoesNotFit:
                if pool is None or not pool.holds_any():
                    raise
                crowded = "does not fit the budget with the other stages kept loaded"
            if pool is not None and crowded and pool.holds_any():
                # Warm stages took the room this one needed: give it back and plan this stage as a
                # one-shot run would; from now on the pool keeps nothing (WarmPool.give_up).
                pool.give_up(f"{self.stage} {crowded}")
                runner.report.notes.append(f"{self.stage}: planned again after releasing the warm stages "
                                           f"(it {crowded})")
                pipe = None  # this stage's first fit goes too, and what it added to the report
                release_freed_memory()
                self.streamed_bytes, self.note = 0, note
                del self.compiled[compiled:]
                pipe = self._load_fitted(folder, to_load, shared, plan_as, *task)
            elif pool is not None and self.streamed_bytes:
                pool.give_up(f"{self.stage} streams {format_bytes(self.streamed_bytes)} of weights even alone")
        if shared:
            pipe.register_modules(**shared)  # objects loaded (and compiled) once for the whole run
        if runner.on_step is not None:
            watch_steps(pipe, self.stage, runner.on_step)
        else:
            vars(pipe).pop("progress_bar", None)  # a warm pipe's watch from an earlier run
        pipe.set_progress_bar_config(disable=not runner.progress, desc=self.stage, leave=False)
        self.components += [label + name for name in to_load]
        self._loaded.append((pipe, to_load, key, made_for))
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
                     pipeline_class: str | None, external: dict, loras):
        runner = self.runner
        already_used = memory_in_use(runner.runtime)
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
        runtime = runner.runtime
        if runtime.can_stream and not runtime.separate_memory and not loras:
            candidates = [name for name in to_load if name not in external]
            if runner.backend is not None:
                candidates = list(served_by_own_weights(folder.components, candidates, runner.backend))
            if runner.backend is not None or self.budget is not None:
                converting = [name for name in candidates if folder.convertible(name, runner.torch_dtype)]
        pipe = folder.load_stage(to_load, runner.torch_dtype, None, in_file_dtype=converting, **task_options)
        if loras:
            from memfit.models.lora import load_loras

            if load_loras(pipe, loras, folder.configs):
                self.note = (self.note + "; " if self.note else "") + f"{len(loras)} LoRA(s), unfused"
        # A component compiled by a backend with its own copy of the weights costs that copy, not its torch
        # weights (memory-mapped once compiled: memfit.compile.weights), and is planned as such.
        compiled = compiled_weight_bytes(pipe, to_load, runner.backend, runner.torch_dtype) if self.budget else {}
        backend, in_blocks = runner.backend, []
        if compiled:
            from memfit.plan.activations import stage_strategies

            # A compiled graph runs the stage's own way (no chunked attention, no banded decode): its activations.
            activations = stage_strategies(folder.adapter, plan_as or self.stage, runner.settings, runner.guided,
                                           runner.dtype)[0].activation_bytes
            stored = compiled_in_store({name: folder.component_fingerprint(name) for name in compiled},
                                       served_by_own_weights(folder.components, list(compiled), backend))
            # A build reads the torch weights in the run dtype: from files in another dtype that is a converted copy
            # in memory, which the compiled model holds on to until the build ends. A stored model is not built.
            converted = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) * runner.torch_dtype.itemsize
                         for name in compiled if name not in stored and folder.file_dtype(name) != runner.torch_dtype}
            compiled, in_blocks, backend = _fit_compiled(self.budget, already_used + activations, compiled, stored,
                                                         self.stage, backend, runner, pipe, converted=converted)
        for name, size in compiled.items():
            runner.report.notes.append(f"{self.stage}: planned {name} as its compiled model, {format_bytes(size)} "
                                       "resident (its torch weights memory-mapped, not counted)")
        self.compiled_costs = compiled  # read by _fit
        self.compiled_in_blocks = in_blocks  # read by _fit
        if self.budget is not None and _has_weights(pipe, [name for name in to_load if name not in compiled]):
            self._fit(pipe, folder, plan_as or self.stage, already_used,
                      dtype=runner.torch_dtype if converting else None)
        else:
            place_whole(pipe, runner.runtime)  # nothing to plan: the whole stage goes where it runs
        if shared:
            pipe.register_modules(**shared)
        # Those the budget left uncompiled were converted by the plan (_fit) like any other component.
        served = [name for name in converting if self.budget is None or name in compiled]
        compile_stage(pipe, folder.path, backend, runner.fallback, self.compiled, folder.component_fingerprint,
                      run_dtypes=dict.fromkeys(served, runner.torch_dtype) if backend is not None else None)
        return pipe

    def _fit(self, pipe, folder: ModelFolder, plan_as: str, already_used: int, dtype: torch.dtype | None = None) -> None:
        from memfit.plan.activations import choose, stage_strategies
        from memfit.run.executor import blocks_not_run, optimize, plan_stage, reads_in_place

        runner = self.runner
        report = runner.report
        budget = self.budget
        if not runner.runtime.separate_memory:
            budget = Budget(device=budget.device, host=0, disk=str(folder.path))
        adapter = folder.adapter
        compiled = self.compiled_costs  # {component: bytes} of compiled models, planned as fixed costs
        already_used += sum(compiled.values())
        options = stage_strategies(adapter, plan_as, runner.settings, runner.guided, runner.dtype)
        parts = adapter.stage_parts.get(plan_as)
        margin = DEVICE_ACTIVATION_MARGIN if runner.runtime.separate_memory else 1.0
        # A compiled model too large for the budget whole runs in blocks: those the plan keeps resident
        # compiled (each a model of its own), the others streamed eagerly. The block models cost more than
        # the weights they replace (_compiled_blocks_extra), so that is set aside and the stage planned again:
        # less room keeps fewer blocks, which need less set aside; the least reserve that holds is kept.
        def plan_with(extra: int):
            room = _room_left(budget, already_used + extra)
            try:
                strategy, plan = choose(options, lambda activations: plan_stage(
                    pipe, room, self.stage, int(activations * margin), parts, skip=compiled, device=runner.runtime,
                    dtype=dtype))
            except MemfitError as exc:
                raise StageDoesNotFit(
                    f"{exc} These figures leave out the {format_bytes(already_used + extra)} this process already "
                    "holds (Python, torch and the libraries loaded"
                    + (", and what its compiled blocks need beyond their weights" if extra else "")
                    + "): add that to any budget named above."
                ) from exc
            found = {name: _compilable_blocks(getattr(pipe, name), name, plan.stages[0].resident, dtype)
                     for name in self.compiled_in_blocks}
            return strategy, plan, found, _compiled_blocks_extra(plan.stages[0], found)

        # The reserve a plan needs shrinks as the reserve grows (less room, fewer blocks): the least reserve
        # that covers what its own plan needs is found by bisection. held: (reserve, the plan made with it).
        first = plan_with(0)
        held = (0, first) if first[3] == 0 else None
        low, high = 0, first[3]
        while low < high and (held is None or high - low > high // 32):
            extra = high if held is None else (low + high) // 2
            try:
                candidate = plan_with(extra)
            except StageDoesNotFit:
                break  # even this reserve leaves too little room: no compiled block is affordable
            if candidate[3] <= extra:
                held, high = (extra, candidate), extra
            else:
                low = extra + 1
        if held is None:  # no reserve holds: the blocks run eagerly, as the plan without one streams them
            strategy, plan, _, _ = first
            compiled_blocks, extra = {name: {} for name in self.compiled_in_blocks}, 0
        else:
            extra, (strategy, plan, compiled_blocks, _) = held
        stage_plan = plan.stages[0]
        already_used += extra
        block_paths = {name: [path for paths in found.values() for path in paths] for name, found in compiled_blocks.items()}
        if runner.runtime.can_stream:
            # On the CPU a compiled component's torch weights stay as loaded (memory-mapped once compiled); on
            # a GPU they move with the plan, so that the pipeline places its inputs where the rest runs.
            skip = () if runner.runtime.separate_memory else {*compiled, *(key for found in compiled_blocks.values()
                                                                          for key in found)}
            optimize(pipe, plan=plan, model_dir=folder.path, device=runner.runtime, parts=parts, dtype=dtype,
                     skip=skip)
        else:
            _refuse_streaming(plan.stages[0], self.stage, runner.runtime)
            place_whole(pipe, runner.runtime)
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
        self._compile_blocks(pipe, folder, block_paths, dtype)
        self.streamed_bytes += stage_plan.streamed_from_host_bytes + stage_plan.streamed_from_disk_bytes
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

    def _compile_blocks(self, pipe, folder: ModelFolder, block_paths: dict[str, list[str]], dtype) -> None:
        runner = self.runner
        served = served_by_own_weights(folder.components, list(block_paths), runner.backend)
        for name, paths in block_paths.items():
            module = getattr(pipe, name)
            if not paths:
                runner.report.notes.append(
                    f"{self.stage}: {name}'s compiled model does not fit the budget whole, and no block of it fits "
                    f"compiled (a block model needs about {1 + COMPILED_BLOCK_OVERHEAD:.1f}x its weights, and "
                    f"{COMPILED_BLOCK_BUILD}x while it is built): {name} runs eagerly as planned")
                continue
            records = compile_blocks(module, name, paths, served[name], fallback=runner.fallback,
                                     fingerprint=folder.component_fingerprint(name), source=folder.path / name,
                                     run_dtype=dtype)
            self.compiled += records
            total = sum(b.numel() for p in paths for b in module.get_submodule(p).parameters())
            runner.report.notes.append(
                f"{self.stage}: {name}'s compiled model does not fit the budget whole: {len(paths)} of its blocks "
                f"({total / 1e6:.0f}M parameters of {sum(p.numel() for p in module.parameters()) / 1e6:.0f}M) run "
                f"compiled with {served[name].name}, each a model of its own, the rest eagerly as planned")

    def _release(self) -> int:
        """Drop every pipeline this stage loaded (or hand it to the runner's pool, which may keep it
        loaded for the next run); returns the weight bytes they held."""
        weights = sum(resident_bytes(pipe, names) for pipe, names, _, _ in self._loaded)
        if self.runner.pool is not None:
            for pipe, _, key, made_for in self._loaded:
                # With its compiled models' buffers: the pool frees them when a stage needs the room.
                self.runner.pool.keep(key, made_for, pipe)
        self._loaded.clear()
        return weights


class StageRunner:
    """Carries out a list of stages with one set of run options; every stage lands in ``report``."""

    def __init__(self, *, report: RunReport, settings: Settings, guided: bool, dtype: str, device: torch.device,
                 budget="auto", backend=None, fallback: str | None = None, progress: bool = True,
                 pool=None, on_step: Callable[[str, int, int], None] | None = None):
        self.report = report
        self.settings = settings
        self.guided = guided
        self.dtype = dtype
        self.torch_dtype = parse_dtype(dtype)
        self.runtime = runtime_for(device)
        self.device = self.runtime.device  # where torch places the run's tensors
        # Resolved now, before any weight loads: the process's own memory is part of the budget.
        self.resolved = resolve_budget(budget, self.runtime, in_use=memory_in_use(self.runtime))
        self.budget = self.resolved.budget
        report.budget = self.resolved.to_dict()
        self.backend = backend
        self.fallback = fallback
        self.progress = progress
        # A long-running caller (memfit.run.session) passes a pool that keeps stage pipelines loaded
        # between runs (take/keep/holds_any/give_up), and on_step(stage, done, total), called as the
        # pipeline's own progress bar advances (it may raise to stop the run).
        self.pool = pool
        self.on_step = on_step
        self.timeline = Timeline(device=self.runtime)
        self._peak: PeakMemory | None = None  # the running stage's, while one runs

    def run(self, stages: list[Stage]) -> dict[str, Any]:
        """Run ``stages`` in order; returns each stage's result by name."""
        results: dict[str, Any] = {}
        with self.timeline:
            for stage in stages:
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
        if self.pool is not None:
            self.pool.give_up(f"{stage.name} ran out of memory")  # kept stages hold memory the retry needs
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
        context = StageContext(self, stage.name, budget)
        release_freed_memory()
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
            note=context.note, planned_peak_bytes=context.planned_peak, strategy=context.strategy,
            device_memory=None if peak.device_peaks is None else peak.device_peaks.to_dict(),
        ))
        report_records(self.report, context.compiled)
        if self.pool is not None:
            self.pool.note_growth(stage.name, peak.peak_bytes - peak.start_bytes, loaded=context.loaded_any)
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


def _refuse_streaming(stage_plan, stage: str, runtime: DeviceRuntime) -> None:
    """A device memfit cannot stream to (mps, xpu) runs a stage only when its plan keeps every weight resident."""
    streamed = stage_plan.streamed_from_host_bytes + stage_plan.streamed_from_disk_bytes
    if streamed:
        raise StageDoesNotFit(
            f"The {stage} stage would stream {format_bytes(streamed)} of weights to fit the budget, and memfit "
            f"streams weights only on cuda and cpu devices, not {runtime.name}: give a larger --budget (or --budget "
            "none to load every weight whole), or run with --device cpu."
        )


def _has_weights(pipe, names) -> bool:
    return any(isinstance(getattr(pipe, name, None), torch.nn.Module) for name in names)


def _fit_compiled(budget: Budget, already_used: int, compiled: dict[str, int], stored: set[str], stage: str,
                  backend, runner, pipe, converted: Mapping[str, int] | None = None):
    """``already_used``: what the process holds plus the stage's activations; ``stored``: the components
    whose compiled model memfit's store holds already (the others are built on their first call);
    ``converted``: bytes of the torch weights a build of the component reads as a converted copy (its files
    are in another dtype than the run's), held beside the build.

    The compiled models a stage keeps whole, those it compiles block by block, and the backend spec it
    compiles the whole ones with. All whole where they fit the budget, with the build of the largest one
    not stored yet; else on the CPU the largest with a forward of blocks (denoisers, text encoders) are
    compiled in blocks, planned like eager weights, until the rest fit; else, with --fallback eager, the
    largest run eagerly; else a refusal naming the budget needed."""
    from memfit.compile.entry_points import entry_points, without_components

    converted = converted or {}

    def needed(kept):
        builds = [COMPILED_WHOLE_BUILD * size + converted.get(name, 0) for name, size in kept.items() if name not in stored]
        return already_used + sum(kept.values()) + int(max(builds, default=0))

    def fits(kept):
        return budget.device is None or needed(kept) <= budget.device

    if fits(compiled):
        return compiled, [], backend
    kept, in_blocks, dropped = dict(compiled), [], []
    if not runner.runtime.separate_memory:
        for name in sorted(compiled, key=compiled.get, reverse=True):
            if fits(kept):
                break
            if entry_points(name, getattr(pipe, name, None)) == ("forward",):
                in_blocks.append(name)
                kept.pop(name)
    parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in kept.items())
    building = [name for name in kept if name not in stored]
    build_note = (f" (with {COMPILED_WHOLE_BUILD}x the largest of {', '.join(building)} more while it is built"
                  + (", and its torch weights converted to the run dtype" if any(n in converted for n in building) else "")
                  + ": memfit's store does not hold it yet)") if building else ""
    if not fits(kept) and runner.fallback != "eager":
        raise StageDoesNotFit(
            f"The {stage} stage's compiled models ({parts}) hold their own weights, which cannot be streamed: with the "
            f"{format_bytes(already_used)} that this process and the stage's activations take, they need "
            f"{format_bytes(needed(kept))}{build_note}, over the budget of "
            f"{format_bytes(budget.device)}. Give --budget {_round_up_mib(needed(kept))}MiB or more, a narrower --precision, "
            "--fallback eager to run what does not fit eagerly, or compile fewer components (e.g. --backend "
            "unet=eager,*=openvino)."
        )
    for name in sorted(kept, key=kept.get, reverse=True):
        if fits(kept):
            break
        dropped.append(name)
        kept.pop(name)
    if dropped:
        runner.report.notes.append(
            f"{stage}: {', '.join(dropped)} run eagerly, not compiled: the compiled models ({parts}) do not fit the "
            f"budget of {format_bytes(budget.device)} with the {format_bytes(already_used)} that this process and the "
            f"stage's activations take{build_note} (--fallback eager)"
        )
    cold_blocks = [name for name in in_blocks if name not in stored and already_used + sum(compiled.values())
                   <= budget.device]
    if cold_blocks:
        runner.report.notes.append(
            f"{stage}: {', '.join(cold_blocks)} compiled in blocks: compiled whole, it fits the budget, but building it "
            f"whole needs about {COMPILED_WHOLE_BUILD}x its size more (and its torch weights in the run dtype, where "
            "its files hold another), and memfit's store does not hold it yet. A run with "
            f"--budget {_round_up_mib(needed(compiled))}MiB (or none) stores it; later runs under this budget use it whole"
        )
    return kept, in_blocks, without_components(backend, dropped + in_blocks)


# What a block compiled as a model of its own holds beyond its weights, as a share of them: the runtime's
# structures and buffers (measured with openvino on the SD 1.5 UNet's blocks in bf16, freeing intermediate
# buffers after each call: 0.35); and what building a block that is not stored yet peaks at beyond it, as a
# multiple of its weights (torch.export, the converted and the compiled model alive together, and the torch
# weights it reads: mapped pages of the files, which a tight budget cannot leave out).
COMPILED_BLOCK_OVERHEAD = 0.4
COMPILED_BLOCK_BUILD = 3
# What building a whole compiled model that is not stored yet needs beyond the model itself, as a multiple of
# it: measured with openvino on the SD 1.5 UNet in bf16 (1.60 GiB), 1.1x of anonymous memory (3.93 GiB peak,
# 0.53 GiB before): mostly the exported stream. The torch weights it reads are mapped pages of the files on top
# (another 1.9 GiB there), which a memory cap reclaims: under a 4 GiB cgroup cap the same build completed with
# its page cache reclaimed. Files in another dtype than the run's are read as a converted copy in memory, which
# the compiled model holds (it keeps the converted model's constants) until the build ends: that is counted on
# top (the SD 1.5 UNet in fp32 from bf16 files, 3.2 GiB: peak 10.3 GiB from 0.5 GiB, 2.1x beyond the model).
COMPILED_WHOLE_BUILD = 1.25


def _compiled_blocks_extra(stage_plan, compiled_blocks: dict[str, dict[str, list[str]]]) -> int:
    """Bytes the compiled blocks ``compiled_blocks`` ({component: {block key: module paths}}) need beyond
    the weights ``stage_plan`` counts for them, a build of the largest of them included."""
    keys = {key for found in compiled_blocks.values() for key in found}
    sizes = [p.bytes for p in stage_plan.placements if f"{p.component}/{p.block}" in keys]
    if not sizes:
        return 0
    return int(COMPILED_BLOCK_OVERHEAD * sum(sizes) + COMPILED_BLOCK_BUILD * max(sizes))


def _compilable_blocks(module: torch.nn.Module, component: str, resident: tuple[str, ...], dtype) -> dict[str, list[str]]:
    """{block key: module paths} for ``component``'s resident blocks that compile as models of their own:
    every unit a whole submodule (not some tensors of one), none holding the anchor module.dtype reads."""
    from memfit.run.executor import live_blocks

    keys = set(resident)
    paths = {id(sub): path for path, sub in module.named_modules()}
    anchor = next(module.parameters(), None)
    found = {}
    for block in live_blocks(component, module, dtype):
        if block.key not in keys or block.fixed_bytes:
            continue
        units = [hooked for hooked, tensors in block.units
                 if paths.get(id(hooked)) and sum(1 for _ in hooked.parameters()) == sum(1 for t in tensors if t[3])
                 and not any(p is anchor for p in hooked.parameters())]
        if units and len(units) == len(block.units):
            found[block.key] = [paths[id(hooked)] for hooked in units]
    return found


def _room_left(budget: Budget, already_used: int) -> Budget:
    """The budget left for a stage's weights and activations once the process's own memory is counted."""
    if budget.device is None:
        return budget
    if budget.device <= already_used:
        raise StageDoesNotFit(
            f"The budget of {format_bytes(budget.device)} is already used up by this process before any weight is "
            f"loaded ({format_bytes(already_used)}: Python, torch and the libraries memfit loaded). Give a budget "
            "above that, or leave it out (auto) to let memfit detect one."
        )
    return Budget(device=budget.device - already_used, host=budget.host, disk=budget.disk)
