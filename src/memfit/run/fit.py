"""Fitting one loaded stage to its budget: plan its weights and activations, carry the plan out, compile.

    fit = fit_stage(pipe, folder, options, stage="denoise", plan_as="denoise", budget=budget,
                    already_used=in_use, converting=[...], settings=settings, guided=True)

``fit`` is a StageFit value (strategy, planned peak, streamed bytes, compile records, report notes);
the stage runner (memfit.run.runner) records it. What it does, in order:

1. Compiled models. A backend that holds its own copy of the weights (OpenVINO) makes a component a
   compiled model that cannot be streamed: memfit.plan.compiled chooses which are kept whole (fixed
   costs for the plan), compiled block by block, or (with --fallback eager) run eagerly. A compiled VAE decodes
   in bands (memfit.run.compiled_banded_decode, bounded activations) where decoding whole does not fit the
   budget beside what the process holds, or, with no budget, beside a Session's kept stages where it would lift
   the process above its measured peak and the bands by clearly less (memfit.plan.compiled.decode_in_bands);
   kept pipelines go, smallest first, where even the bands do not fit (WarmPool.release_smallest).
2. The plan. The budget left once the process's own memory is counted (memfit.plan.budget.stage_budget)
   is planned for the stage's components together with the activations of each strategy the family
   allows (memfit.plan.activations), and the first strategy that keeps every weight resident wins (else
   the cheap one that keeps the most). On a CPU-only machine host RAM *is* the device, so what does not
   fit stays memory-mapped from the model's own safetensors files (the disk tier), never a second copy.
   Compiled blocks cost more than the weights they replace: that reserve is set aside and the stage planned
   again, the least reserve that holds kept.
3. The plan carried out (memfit.run.executor.optimize), then the compiled blocks and the whole compiled
   models built or loaded from memfit's store.

Before any stage runs, ``check_budget_floor`` refuses a budget below the smallest that can work for the
whole run, naming the budget to give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from memfit.compile.entry_points import (compile_blocks, compile_stage, compiled_in_store, compiled_weight_bytes,
                                        entry_points, served_by_own_weights, without_components)
from memfit.devices import DeviceRuntime
from memfit.errors import MemfitError
from memfit.models.families import Settings
from memfit.models.folder import ModelFolder
from memfit.plan.activations import (DENOISE_HEAP_THRESHOLD, DEVICE_ACTIVATION_MARGIN, StrategyKind, choose,
                                     decode_gains_from_heap, decode_heap_slack, stage_strategies, vae_execution_dtype)
from memfit.plan.budget import Budget, BudgetTooSmall, StageDoesNotFit, stage_budget
from memfit.plan.compiled import (COMPILED_BLOCK_BUILD, COMPILED_BLOCK_OVERHEAD, choose_compiled, compiled_bands_extra,
                                  compiled_blocks_extra, decode_in_bands)
from memfit.plan.stages import planned_with_heap_where_it_fits
from memfit.run.executor import (blocks_not_run, host_tier_reused, keep_dequantized, live_blocks, optimize, plan_stage,
                                 reads_in_place)
from memfit.run.memory import mmap_threshold_fixed, process_peak_rss, return_large_frees_to_os
from memfit.run.options import RunOptions
from memfit.sizes import format_bytes

__all__ = ["PROCESS_GROWTH_DIVISOR", "StageFit", "check_budget_floor", "fit_stage", "place_whole"]

# What the process gains before the last stage starts (the pipeline's modules imported, tokenizers,
# allocator pools), as a share of what it holds at the start: ~11% (40 MiB) on the tiny SD model.
PROCESS_GROWTH_DIVISOR = 8


@dataclasses.dataclass(frozen=True)
class StageFit:
    """What fitting one load of a stage decided and did.

    strategy:       how the stage holds its activations ("" where nothing was planned);
    planned_peak:   the peak the plan predicts for the process (None where nothing was planned);
    streamed_bytes: weights the plan left off the device (streamed);
    tiers:          per planned component, its weights' bytes by tier ({"unet": {"device": .., "disk": ..}});
    compiled:       the compile records of the load (they fill in as entries compile during the stage);
    notes:          what the run report says about it, in order;
    heap_temporaries: the plan counted the heap the stage's temporaries come from: the denoising loop's under
                    memfit.run.memory.DENOISE_HEAP_THRESHOLD (memfit.plan.activations.heap_slack), the plain decode's
                    of every size (memfit.run.memory.every_temporary_from_heap).
    """

    strategy: StrategyKind | str = ""
    planned_peak: int | None = None
    streamed_bytes: int = 0
    tiers: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    compiled: tuple = ()
    notes: tuple[str, ...] = ()
    heap_temporaries: bool = False


def fit_stage(pipe, folder: ModelFolder, names: Sequence[str], options: RunOptions, *, stage: str, plan_as: str,
              budget: Budget | None, already_used: int, converting: Collection[str], settings: Settings,
              guided: bool, auto_budget: bool = True, shared: Mapping[str, Any] | None = None) -> StageFit:
    """Fit the freshly loaded ``pipe`` (``names``: the components of ``folder`` this load of ``stage`` loaded) to
    ``budget``.

    ``plan_as`` names the activation rules to plan with; ``already_used`` is what the process holds now;
    ``converting`` the components loaded in their files' dtype, converted to the run's as planned;
    ``auto_budget``: the budget was detected (a run that keeps every weight then changes no allocator
    setting); ``shared`` modules another load of this run fitted and compiled are registered before the
    stage compiles (they are reused, not compiled again). Raises StageDoesNotFit when no plan fits.
    """
    notes: list[str] = []
    backend, in_blocks = options.backend, ()
    # A compiled VAE whose decode can run in bands: (plain, banded) activations, else None.
    band_options = _band_options(pipe, folder, names, options, plan_as, settings, guided)
    # A component compiled by a backend with its own copy of the weights costs that copy, not its torch
    # weights (memory-mapped once compiled: memfit.compile.weights), and is planned as such.
    compiled = compiled_weight_bytes(pipe, names, backend, options.torch_dtype) if budget is not None else {}
    let_go_before = len(getattr(options.pool, "let_go", ()))
    choice, in_bands, already_used = _compiled_choice(pipe, folder, options, stage=stage, plan_as=plan_as,
                                                      budget=budget, already_used=already_used, compiled=compiled,
                                                      band_options=band_options, settings=settings, guided=guided,
                                                      backend=backend)
    let_go = getattr(options.pool, "let_go", [])[let_go_before:]
    if let_go:
        notes.append(f"{stage}: does not fit beside the kept {', '.join(let_go)}: let go, loaded again for each run "
                     "from now on")
    if choice is not None:
        compiled, in_blocks = dict(choice.kept), choice.in_blocks
        backend = without_components(backend, [*choice.dropped, *in_blocks])
        notes += choice.notes
    if in_bands and options.pool is not None and hasattr(options.pool, "bounded"):
        options.pool.bounded.add(stage)  # its warm runs too run beside the kept weights, not their buffers
    if in_bands:
        backend = without_components(backend, ["vae"])  # its band kernels are compiled below instead
        notes.append(
            f"{stage}: vae compiled in bands (a model per conv, each band's buffers freed after it; GroupNorm "
            f"statistics over the whole tensor): planned activations {format_bytes(band_options[1])} instead of "
            f"{format_bytes(band_options[0])} decoding whole, "
            + ("which does not fit the budget beside what this process holds" if budget is not None else
               f"which would lift the process above the {format_bytes(process_peak_rss())} it already reached"))
    for name, size in compiled.items():
        notes.append(f"{stage}: planned {name} as its compiled model, {format_bytes(size)} "
                     "resident (its torch weights memory-mapped, not counted)")
    records: list = []
    fit = StageFit()
    if budget is not None and _has_weights(pipe, [name for name in names if name not in compiled]):
        fit = _plan_and_place(pipe, folder, options, stage=stage, plan_as=plan_as, budget=budget,
                              already_used=already_used + sum(compiled.values()), compiled=compiled,
                              in_blocks=in_blocks, dtype=options.torch_dtype if converting else None,
                              settings=settings, guided=guided, auto_budget=auto_budget, records=records)
    else:
        place_whole(pipe, options.runtime)  # nothing to plan: the whole stage goes where it runs
    if shared:
        pipe.register_modules(**shared)
    # Those the budget left uncompiled were converted by the plan like any other component.
    served = [name for name in converting if budget is None or name in compiled]
    compile_stage(pipe, folder.path, backend, options.fallback, records, folder.component_fingerprint,
                  run_dtypes=dict.fromkeys(served, options.torch_dtype) if backend is not None else None)
    if in_bands:
        from memfit.run.compiled_banded_decode import compile_band_kernels, enable_compiled_banded_decode

        enable_compiled_banded_decode(pipe.vae)
        kernels_backend = served_by_own_weights(folder.components, ["vae"], options.backend)["vae"]
        records += compile_band_kernels(pipe.vae, "vae", kernels_backend, fallback=options.fallback,
                                        fingerprint=folder.component_fingerprint("vae"), source=folder.path / "vae",
                                        run_dtype=options.torch_dtype if "vae" in converting else None)
        fit = dataclasses.replace(fit, strategy=StrategyKind.BANDED)
    return dataclasses.replace(fit, compiled=tuple(records), notes=(*notes, *fit.notes))


def _compiled_choice(pipe, folder: ModelFolder, options: RunOptions, *, stage: str, plan_as: str,
                     budget: Budget | None, already_used: int, compiled: dict[str, int],
                     band_options: tuple[int, int] | None, settings: Settings, guided: bool,
                     backend) -> tuple[Any, bool, int]:
    """(choice, in_bands, already_used): which compiled models the stage keeps whole, compiles in blocks or drops
    (a CompiledChoice of memfit.plan.compiled.choose_compiled; None where nothing is compiled under a budget),
    whether its compiled VAE decodes in bands, and what the process holds once kept pipelines were let go for it.

    Why: a VAE compiled whole allocates every full-resolution buffer of its graph at once, which may not fit
    the budget beside what the process holds (a Session's kept stages) or, with no budget, lift the process
    above the peak it already reached; in bands (memfit.run.compiled_banded_decode) its activations are bounded.
    Where even the bands do not fit, kept pipelines go, smallest first (WarmPool.release_smallest), before the
    stage is refused. Raises BudgetTooSmall where no choice fits.
    """
    choice, in_bands = None, False
    if compiled:
        choose = functools.partial(_choose_compiled, pipe, folder, options, stage, plan_as, budget, already_used,
                                   compiled, settings, guided)
        try:
            choice = choose()
        except BudgetTooSmall:
            if band_options is None:
                raise
            choice = None
        if band_options is not None and (choice is None or "vae" not in choice.kept):
            # Decoded whole, the compiled VAE does not fit beside what the process holds (a Session's kept
            # stages); in bands its activations are bounded: compiled, in bands, where that fits. Where that does
            # not fit either, the pool lets its smallest kept pipelines go (a text encoder before the denoiser)
            # until it does, and keeps the rest; once one went, decoding whole may fit, and is faster (the SD 1.5
            # VAE at 512x512 in bf16: 6.4 s whole against 9.5 s in bands).
            while True:
                try:
                    banded, refused = choose(activations=band_options[1]), None
                except BudgetTooSmall as exc:
                    banded, refused = None, exc
                if (banded is not None and "vae" in banded.kept) or not _release_smallest(options.pool):
                    break
                already_used = options.runtime.memory_in_use()
                choose = functools.partial(_choose_compiled, pipe, folder, options, stage, plan_as, budget,
                                           already_used, compiled, settings, guided)
                with contextlib.suppress(BudgetTooSmall):
                    choice = choose()
                if choice is not None and "vae" in choice.kept:
                    banded = None
                    break
            if banded is not None and "vae" in banded.kept:
                choice, in_bands = banded, True
            elif choice is None:
                if refused is not None:
                    raise refused  # the smallest budget it names is the banded decode's
                choice = banded
    elif band_options is not None and budget is None and options.pool is not None and options.pool.holds_any():
        # Without a budget only beside kept stages (a Session's): a one-shot run has let its denoiser go by now.
        vae_bytes = compiled_weight_bytes(pipe, ["vae"], backend, options.torch_dtype).get("vae", 0)
        ceiling = process_peak_rss()
        in_bands = decode_in_bands(ceiling=ceiling, already_used=already_used, compiled_bytes=vae_bytes,
                                   plain=band_options[0], banded=band_options[1])
        if in_bands and options.pool is not None:
            # Beside the kept weights, not their buffers; and, to stay under the peak, without the smaller kept
            # pipelines where need be (never the largest: with no budget a Session keeps its denoiser).
            options.pool.free_buffers()
            already_used = options.runtime.memory_in_use()
            while already_used + vae_bytes + band_options[1] > ceiling and \
                    _release_smallest(options.pool, spare_largest=True):
                already_used = options.runtime.memory_in_use()
    return choice, in_bands, already_used


def _release_smallest(pool, *, spare_largest: bool = False) -> bool:
    """Let the pool's smallest kept pipeline go (WarmPool.release_smallest); False where there is none to let go."""
    release = getattr(pool, "release_smallest", None)
    return bool(release is not None and release(spare_largest=spare_largest))


def _band_options(pipe, folder: ModelFolder, names: Sequence[str], options: RunOptions, plan_as: str,
                  settings: Settings, guided: bool) -> tuple[int, int] | None:
    """(plain, banded) planned activations of the decode where its VAE is compiled by a backend with its own
    copy of the weights on the CPU and can be decoded in bands (memfit.run.compiled_banded_decode); else None.
    The banded figure counts what the band kernels hold beyond the compiled weights (compiled_bands_extra)."""
    from memfit.run.banded_decode import unsupported_reason

    vae = getattr(pipe, "vae", None)
    if plan_as != "decode" or "vae" not in names or vae is None or options.runtime.separate_memory:
        return None
    if "vae" not in served_by_own_weights(folder.components, ["vae"], options.backend) or unsupported_reason(vae):
        return None
    choices = stage_strategies(folder.adapter, plan_as, settings, guided, options.dtype)
    banded = next((choice for choice in choices if choice.name == StrategyKind.BANDED), None)
    if banded is None:
        return None
    extra = compiled_bands_extra(vae.config, width=settings.width, height=settings.height,
                                 dtype=vae_execution_dtype(vae.config, options.dtype))
    return choices[0].activation_bytes, banded.activation_bytes + extra


def _choose_compiled(pipe, folder: ModelFolder, options: RunOptions, stage: str, plan_as: str, budget: Budget,
                     already_used: int, compiled: dict[str, int], settings: Settings, guided: bool,
                     activations: int | None = None):
    # A compiled graph runs the stage's own way (no chunked attention, no banded decode): its activations, unless
    # the caller names others (a VAE compiled in bands).
    if activations is None:
        activations = stage_strategies(folder.adapter, plan_as, settings, guided, options.dtype)[0].activation_bytes
    served = served_by_own_weights(folder.components, list(compiled), options.backend)
    stored = compiled_in_store({name: folder.component_fingerprint(name) for name in compiled}, served)
    # A build reads the torch weights in the run dtype: from files in another dtype that is a converted copy
    # in memory, which the compiled model holds on to until the build ends. A stored model is not built.
    converted = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) * options.torch_dtype.itemsize
                 for name in compiled if name not in stored and folder.file_dtype(name) != options.torch_dtype}
    # Only on the CPU are blocks planned (and compiled) like weights; a forward of blocks is what splits.
    blockable = () if options.runtime.separate_memory else \
        [name for name in compiled if entry_points(name, getattr(pipe, name, None)) == ("forward",)]
    return choose_compiled(stage=stage, budget_bytes=budget.device, already_used=already_used + activations,
                           compiled=compiled, stored=stored, converted=converted, blockable=blockable,
                           fallback_eager=options.fallback == "eager")


def _plan_and_place(pipe, folder: ModelFolder, options: RunOptions, *, stage: str, plan_as: str, budget: Budget,
                    already_used: int, compiled: Mapping[str, int], in_blocks: Sequence[str],
                    dtype: torch.dtype | None, settings: Settings, guided: bool, auto_budget: bool,
                    records: list) -> StageFit:
    """Plan the stage's eager weights and activations (compiled models as fixed costs), carry the plan out and
    compile the blocks ``in_blocks`` components keep resident; the whole compiled models are the caller's."""
    runtime = options.runtime
    adapter = folder.adapter
    parts = adapter.stage_parts.get(plan_as)
    margin = DEVICE_ACTIVATION_MARGIN if runtime.separate_memory else 1.0
    stream_from = None if runtime.separate_memory else str(folder.path)
    # Experts that run one at a time are planned apart, a stage each (the plan's "denoise:transformer", ...).
    phases = adapter.present_experts([name for name in adapter.experts
                                      if name not in compiled and getattr(pipe, name, None) is not None])

    # A compiled model too large for the budget whole runs in blocks: those the plan keeps resident compiled
    # (each a model of its own), the others streamed eagerly. The block models cost more than the weights
    # they replace (compiled_blocks_extra), so that is set aside and the stage planned again: less room keeps
    # fewer blocks, which need less set aside; the least reserve that holds is kept.
    host_tiers = options.pool.host_tiers if options.pool is not None and runtime.separate_memory else None
    kept_host = 0 if host_tiers is None else host_tiers.nbytes()

    def plan_with(extra: int, choices):
        room = stage_budget(budget, runtime, already_used=already_used + extra, stream_from=stream_from,
                            kept_host=kept_host)
        try:
            strategy, plan = choose(choices, lambda activations: plan_stage(
                pipe, room, stage, int(activations * margin), parts, skip=compiled, dtype=dtype, device=runtime,
                phases=phases))
        except BudgetTooSmall as exc:
            # The planner saw only what is left for the stage: refused again with the budget the user gave.
            raise exc.counting(budget.device, already_used + extra, "Python, torch, the libraries"
                               + (", what its compiled blocks need beyond their weights" if extra else "")) from exc
        except MemfitError as exc:
            raise StageDoesNotFit(
                f"{exc} These figures leave out the {format_bytes(already_used + extra)} this process already "
                "holds (Python, torch and the libraries loaded"
                + (", and what its compiled blocks need beyond their weights" if extra else "")
                + "): add that to any budget named above."
            ) from exc
        resident = tuple(key for planned in plan.stages for key in planned.resident)
        found = {name: _compilable_blocks(getattr(pipe, name), name, resident, dtype) for name in in_blocks}
        keys = {key for blocks in found.values() for key in blocks}
        extra_needed = compiled_blocks_extra(
            [p.bytes for p in _placements(plan) if f"{p.component}/{p.block}" in keys])
        return strategy, plan, found, extra_needed

    def first_plan(heap_temporaries: bool):
        choices = stage_strategies(adapter, plan_as, settings, guided, options.dtype, heap_temporaries=heap_temporaries)
        return choices, plan_with(0, choices)

    # On the CPU the denoising loop's temporaries come from the heap when the plan can count what that holds;
    # where it cannot, the stage is planned (and run) without it rather than refused.
    (choices, first), with_heap = planned_with_heap_where_it_fits(
        first_plan, heap_temporaries=plan_as == "denoise" and not runtime.separate_memory)
    # The reserve a plan needs shrinks as the reserve grows (less room, fewer blocks): the least reserve
    # that covers what its own plan needs is found by bisection. held: (reserve, the plan made with it).
    held = (0, first) if first[3] == 0 else None
    low, high = 0, first[3]
    while low < high and (held is None or high - low > high // 32):
        extra = high if held is None else (low + high) // 2
        try:
            candidate = plan_with(extra, choices)
        except StageDoesNotFit:
            break  # even this reserve leaves too little room: no compiled block is affordable
        if candidate[3] <= extra:
            held, high = (extra, candidate), extra
        else:
            low = extra + 1
    if held is None:  # no reserve holds: the blocks run eagerly, as the plan without one streams them
        strategy, plan, _, _ = first
        blocks_compiled, extra = {name: {} for name in in_blocks}, 0
    else:
        extra, (strategy, plan, blocks_compiled, _) = held
    already_used += extra
    notes: list[str] = []
    streamed = sum(s.streamed_from_host_bytes + s.streamed_from_disk_bytes for s in plan.stages)
    if not auto_budget or strategy is not choices[0] or streamed or phases:
        # Freed activations (and an expert released: optimize's phases) then leave RSS at once, so the stage
        # stays within its plan. Not set while an automatic budget holds everything: that run then costs
        # nothing a plain one does not.
        return_large_frees_to_os()
    if runtime.can_stream:
        # On the CPU a compiled component's torch weights stay as loaded (memory-mapped once compiled); on
        # a GPU they move with the plan, so that the pipeline places its inputs where the rest runs.
        skip = () if runtime.separate_memory else {*compiled, *(key for found in blocks_compiled.values()
                                                               for key in found)}
        optimize(pipe, plan=plan, model_dir=folder.path, device=runtime, parts=parts, dtype=dtype, skip=skip,
                 stage=stage, phases=phases, host_tiers=host_tiers)
        reused = host_tier_reused(pipe)
        if reused:
            notes.append(f"{stage}: its pinned host tier ({format_bytes(reused)}) kept from the last run, not "
                         "page-locked or read again")
    else:
        for planned_stage in plan.stages:
            _refuse_streaming(planned_stage, stage, runtime)
        place_whole(pipe, runtime)
    if with_heap:
        notes.append(f"{stage}: temporaries under {format_bytes(DENOISE_HEAP_THRESHOLD)} from the heap, the holes it "
                     "keeps counted with the activations")
    if phases:
        notes.append(f"{stage}: {' and '.join(phases)} run one at a time: each planned apart, {phases[0]} placed "
                     f"first, each next one brought in at its first call and the one before released")
    if strategy.name == StrategyKind.BANDED:
        from memfit.run.banded_decode import enable_banded_decode

        enable_banded_decode(pipe.vae)
    if strategy.tiling is not None:
        # Set on the VAE this load made: a Session that keeps the stage decodes its warm runs the same way.
        pipe.vae.enable_tiling(**strategy.tiling.enable_kwargs)
        notes.append(
            f"{stage}: {strategy.tiling.describe()}, because decoding untiled needs "
            f"{format_bytes(choices[0].activation_bytes)} of activations, which the budget cannot hold: the output "
            "equals diffusers' with that tiling, and differs from an untiled decode's where the tiles blend "
            "(a larger --budget decodes untiled)")
    unrun = blocks_not_run(pipe)
    if unrun:
        notes.append(
            f"{stage}: {format_bytes(sum(b.bytes for b in unrun))} of weights the stage does not run "
            f"({', '.join(sorted({b.component + '/' + b.name.split('.')[0] for b in unrun}))}) left memory-mapped "
            "on disk, outside the plan"
        )
    block_paths = {name: [path for paths in found.values() for path in paths] for name, found in blocks_compiled.items()}
    notes += _compile_blocks(pipe, folder, options, stage, block_paths, dtype, records)
    # The plan fits the read-ahead into the budget (a cgroup cap charges the page cache), but read in
    # place it is mapped into this process only once its block runs: the predicted peak RSS leaves it out.
    in_place = reads_in_place(pipe)
    read_aheads = [s.stream_window_bytes - s.largest_streamed_bytes if in_place else 0 for s in plan.stages]
    read_ahead = max(read_aheads)
    if read_ahead:
        notes.append(f"{stage}: {format_bytes(read_ahead)} read ahead into the page cache, "
                     "outside this process's memory until its block runs")
    if strategy is not choices[0] and strategy.tiling is None:
        notes.append(
            f"{stage}: {strategy.name} (activations {format_bytes(strategy.activation_bytes)} instead of "
            f"{format_bytes(choices[0].activation_bytes)} for {choices[0].name}), so more weights stay resident"
        )
    for planned_stage in plan.stages:
        notes.append(
            f"plan {planned_stage.name}: {format_bytes(planned_stage.resident_bytes)} resident, "
            f"{format_bytes(planned_stage.streamed_from_host_bytes)} streamed from host, "
            f"{format_bytes(planned_stage.streamed_from_disk_bytes)} streamed from disk (memory-mapped), "
            f"activations {format_bytes(planned_stage.activation_bytes)}"
        )
    tiers: dict[str, dict[str, int]] = {}
    for placement in _placements(plan):
        by_tier = tiers.setdefault(placement.component, {})
        by_tier[str(placement.where)] = by_tier.get(str(placement.where), 0) + placement.bytes
    # Phases run one after another: the stage's peak is the highest of theirs.
    planned_peak = already_used + max(s.peak_bytes - ahead for s, ahead in zip(plan.stages, read_aheads))
    if runtime.can_stream:
        # Room the plan leaves: resident quantized weights kept dequantized there run without dequantizing.
        kept = keep_dequantized(pipe, None if budget.device is None else budget.device - planned_peak,
                                options.torch_dtype)
        if kept:
            planned_peak += kept
            notes.append(f"{stage}: {format_bytes(kept)} of resident quantized weights kept dequantized, which the "
                         "budget has room for, so they are not dequantized at each step")
    heap_slack = decode_heap_slack(strategy.activation_bytes)
    if _decodes_from_heap(plan_as, strategy, choices, options, adapter.configs.get("vae", {}),
                          [*compiled, *in_blocks], streamed, phases, budget, planned_peak + heap_slack):
        planned_peak += heap_slack
        with_heap = True
        notes.append(f"{stage}: temporaries of every size from the heap (no fresh pages for each), the "
                     f"{format_bytes(heap_slack)} it may hold beside them counted")
    return StageFit(strategy=strategy.name, planned_peak=planned_peak, streamed_bytes=streamed, tiers=tiers,
                    notes=tuple(notes), heap_temporaries=with_heap)


def _decodes_from_heap(plan_as: str, strategy, choices, options: RunOptions, vae_config, compiled: Collection[str],
                       streamed: int, phases, budget: Budget, peak_with_heap: int) -> bool:
    """Whether the plain decode takes its temporaries of every size from the heap
    (memfit.run.memory.every_temporary_from_heap): on the CPU, an eager decode the heap was measured to speed up
    (memfit.plan.activations.decode_gains_from_heap) that keeps every weight, in a process whose mmap threshold
    memfit left to glibc, with room in the budget for what the heap holds beside the activations
    (memfit.plan.activations.decode_heap_slack); `memfit plan` decides the same (memfit.cli.plan)."""
    return (plan_as == "decode" and not options.runtime.separate_memory and "vae" not in compiled
            and strategy is choices[0] and strategy.name == StrategyKind.PLAIN
            and decode_gains_from_heap(choices, vae_config, options.dtype) and not streamed and not phases
            and not mmap_threshold_fixed() and budget.device is not None and peak_with_heap <= budget.device)


def _placements(plan) -> list:
    """Every block's placement in ``plan`` once (a block several phases run: as the first places it)."""
    seen: dict[tuple[str, str], object] = {}
    for planned_stage in plan.stages:
        for placement in planned_stage.placements:
            seen.setdefault((placement.component, placement.block), placement)
    return list(seen.values())


def _compile_blocks(pipe, folder: ModelFolder, options: RunOptions, stage: str, block_paths: dict[str, list[str]],
                    dtype: torch.dtype | None, records: list) -> list[str]:
    """Compile the resident blocks ``block_paths`` ({component: module paths}) as models of their own; the notes."""
    notes = []
    served = served_by_own_weights(folder.components, list(block_paths), options.backend)
    for name, paths in block_paths.items():
        module = getattr(pipe, name)
        if not paths:
            notes.append(
                f"{stage}: {name}'s compiled model does not fit the budget whole, and no block of it fits "
                f"compiled (a block model needs about {1 + COMPILED_BLOCK_OVERHEAD:.1f}x its weights, and "
                f"{COMPILED_BLOCK_BUILD}x while it is built): {name} runs eagerly as planned")
            continue
        records += compile_blocks(module, name, paths, served[name], fallback=options.fallback,
                                  fingerprint=folder.component_fingerprint(name), source=folder.path / name,
                                  run_dtype=dtype)
        total = sum(b.numel() for p in paths for b in module.get_submodule(p).parameters())
        notes.append(
            f"{stage}: {name}'s compiled model does not fit the budget whole: {len(paths)} of its blocks "
            f"({total / 1e6:.0f}M parameters of {sum(p.numel() for p in module.parameters()) / 1e6:.0f}M) run "
            f"compiled with {served[name].name}, each a model of its own, the rest eagerly as planned")
    return notes


def _compilable_blocks(module: torch.nn.Module, component: str, resident: tuple[str, ...], dtype) -> dict[str, list[str]]:
    """{block key: module paths} for ``component``'s resident blocks that compile as models of their own:
    every unit a whole submodule (not some tensors of one), none holding the anchor module.dtype reads."""
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


def check_budget_floor(adapter, settings: Settings, dtype: str, budget: Budget | None,
                       runtime: DeviceRuntime, *, above_process: bool = False, in_use: int | None = None) -> None:
    """Refuse, before any stage runs, a budget below the smallest that can work for the whole run.

    Each stage's floor (its cheapest activation strategy with every block streamed) comes from the
    configs alone (memfit.plan.stages, meta-device sizing); the process's own memory is added, unless
    the budget was given ``above_process`` ("+SIZE"): ``in_use``, or what ``runtime`` reads now. One message
    names the budget to give, instead of one stage's shortfall after another.
    """
    from memfit.plan.planner import minimum_device_bytes
    from memfit.plan.stages import stage_options

    if budget is None or budget.device is None:
        return
    try:
        options = stage_options(adapter, dtype=dtype, width=settings.width, height=settings.height,
                                steps=settings.steps, num_frames=getattr(settings, "num_frames", None))
    except MemfitError:
        return  # a class the planner cannot size: each stage's own check still applies
    floors = {opts[0][1].name: min(minimum_device_bytes(stage) for _, stage in opts) for opts in options}
    worst = max(floors, key=floors.get)
    if above_process:
        if budget.device >= floors[worst]:
            return
        # What a stage holds at its start drifts a little before its weights load: a MiB of slack named.
        raise BudgetTooSmall(budget.device, floors[worst] + (1 << 20),
                             f"the {worst} stage with every weight streamed, on top of this process", on_top=True)
    already = runtime.memory_in_use() if in_use is None else in_use
    if budget.device >= already + floors[worst]:
        return  # it may still fall short at a later stage, which then says so itself
    if not runtime.separate_memory:
        # Counted in the budget this names, not in the refusal: only a budget that cannot work is refused.
        # A GPU starts empty.
        already += already // PROCESS_GROWTH_DIVISOR
    raise BudgetTooSmall(
        budget.device, already + floors[worst],
        f"about {format_bytes(already)} for this process (Python, torch, the libraries), plus "
        f"{format_bytes(floors[worst])} for the {worst} stage with every weight streamed")


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
