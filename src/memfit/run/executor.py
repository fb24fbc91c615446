"""The executor: carry out a Plan on a live diffusers pipeline, and undo it.

    pipe = memfit.optimize(pipe, budget="6GiB")   # same object; pipe._memfit_plan holds the Plan
    memfit.restore(pipe)                          # every hook gone, every parameter as before

What each tier means for a block's weights (the plan's "device" / "host" / "disk"):

  execution device   device                 host                            disk
  CUDA               moved to the GPU       a place in the stage's one      mmap'd view of the model's own
                     for the whole run      pinned arena; copied in for     safetensors; read into a pinned staging
                                            each forward (next block        ring by a reader thread, copied in from
                                            prefetched on a side stream)    there, converted on the GPU
  CPU                untouched              untouched (host RAM *is* the    the parameter's data IS the mmap'd view
                                            device)                         (no copy; the kernel may drop and re-read
                                                                            pages); if the run dtype differs from the
                                                                            file's, converted into a temporary just
                                                                            before the forward, next block converted
                                                                            ahead on a background thread

A weight is never parked on ``meta`` and never replaced by a fake tensor; only ``param.data``
changes, between real storages. Blocks are found on the live modules with
the same splitting rule as meta.py, so plan keys ("unet/down_blocks.0") match ``memfit plan``;
no meta model is ever built or attached here (failure 3).

Known limits, chosen on purpose:
  * The first parameter of every component is never offloaded: diffusers' and transformers'
    ``module.dtype`` / ``module.device`` read it, and the pipeline uses them to place latents and
    cast embeddings. It is a single tensor (usually a small embedding or conv); on a GPU it is moved
    there whatever its block's tier, so ``module.device`` names the GPU and the run never mixes devices.
  * A disk-tier weight must equal what the model's safetensors file holds (after conversion to the
    run dtype); optimize checks this once, block by block, and raises naming the first weight that
    differs (e.g. after fusing a LoRA), instead of silently running other weights. An unfused LoRA
    (PEFT layers, as diffusers' load_lora_weights leaves it) keeps the original weight as
    ``base_layer``, which maps to the file's key; the LoRA's own tensors (lora_A, lora_B) are in no
    file and stay on the host tier whatever the plan says.
  * Buffers are not put on the disk tier (they are small and often not saved); on CUDA they travel
    with their block like host-tier weights.
  * ``.to()`` after optimize is supported where it is a no-op for the placed tensors (``.to("cpu")``
    on a CPU run); to move an optimized pipeline elsewhere, restore, move, and optimize again.
  * A weight read by a parent module directly (``self.child.weight``) inside a forward that is not
    its own block's runs on its home form: correct on a CPU run with matching dtypes (the home is the
    weight), a device/dtype error otherwise, never wrong numbers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import threading
import weakref
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

import torch

from memfit.devices import DeviceRuntime, runtime_for
from memfit.plan.budget import AUTO, NONE, Budget, BudgetLike, resolve_budget, stage_budget
from memfit.errors import MemfitError
from memfit.run.offload import (BlockSlots, HookRegistry, PhaseSwitch, Phases, Prefetches, ResidentHook, Runtime, Shared, Slot,
                                SlotKind, StagingRing, SwapHook, aligned, inference_mode_for)
from memfit.quant.formats import dequantized_elements
from memfit.run.weight_sources import WeightSource, in_memory_only, weight_source
from memfit.safetensors_header import same_samples
from memfit.plan.planner import BlockSpec, Plan, StageInput, Tier, alternating, make_plan, phase_stages

__all__ = ["KeptHostTiers", "host_tier_reused", "optimize", "restore", "is_optimized", "keep_dequantized", "live_blocks", "plan_stage", "unrun_blocks",
           "blocks_not_run", "reads_in_place", "refuse_cuda_graphs_while_streaming"]

STATE_ATTR = "_memfit_state"
PLAN_ATTR = "_memfit_plan"
COMPILE_RECORDS_ATTR = "_memfit_compile_records"


@dataclasses.dataclass
class LiveBlock:
    """A block of a live component: plan key, size, and the (hooked module, tensors) units it is made of."""

    component: str
    name: str
    bytes: int
    # (module whose forward covers the tensors, [(owner module, attribute name, tensor, is_param, full name)])
    units: list
    # the component's anchor (and any tensor in no file), if in this block: it stays on the device whatever the tier
    fixed_bytes: int = 0
    # its largest weight stored smaller than it runs (memfit.quant), dequantized: held while its layer runs
    scratch_bytes: int = 0

    @property
    def key(self) -> str:
        return f"{self.component}/{self.name}"


@dataclasses.dataclass
class _State:
    runtime: Runtime
    slots: list  # every Slot memfit changed, hooked or not
    hooked: list  # modules that carry a SwapHook
    marked: list = dataclasses.field(default_factory=list)  # modules of resident blocks that carry a ResidentHook
    dtype: torch.dtype | None = None  # the run dtype of floating weights loaded in their files' dtype
    # CPU, and the plan streams from disk: resident weights get memory of their own (see _own_memory)
    own_resident: bool = False
    unrun: list = dataclasses.field(default_factory=list)  # LiveBlocks outside the stage's parts, parked on disk
    arenas: list = dataclasses.field(default_factory=list)  # pinned host memory: the host tier's, the staging ring
    # (slot, where its values are read from) for the host tier, placed in one arena once all are known
    host_sources: list = dataclasses.field(default_factory=list)
    dequantized: list = dataclasses.field(default_factory=list)  # quantized layers keeping their weight dequantized
    phases: Phases | None = None  # components that run one at a time (optimize's ``phases``)
    switched: list = dataclasses.field(default_factory=list)  # the components that carry a PhaseSwitch
    # (arena, what it holds, its stage, the KeptHostTiers it goes back to on release, not to the device)
    kept: list = dataclasses.field(default_factory=list)
    host_tier_reused: int = 0  # bytes of host tier taken filled from KeptHostTiers (not pinned or read again)


# --- public -------------------------------------------------------------------------------------


def is_optimized(pipe) -> bool:
    return STATE_ATTR in vars(pipe)


def host_tier_reused(pipe) -> int:
    """The bytes of ``pipe``'s pinned host tier that optimize took filled from its ``host_tiers``."""
    state = vars(pipe).get(STATE_ATTR)
    return 0 if state is None else state.host_tier_reused


def reads_in_place(pipe) -> bool:
    """True when every streamed weight of ``pipe`` is used straight from its memory map (CPU, file
    dtype = run dtype): a block read ahead then sits in the page cache and is mapped into this
    process only while it runs, instead of being a copy in the process's memory."""
    state = vars(pipe).get(STATE_ATTR)
    return state is not None and not state.runtime.separate_memory and all(
        slot.home_tensor().dtype == slot.dtype for slot in state.slots if slot.kind == SlotKind.MMAP
    )


def optimize(
    pipe,
    budget: BudgetLike | None = AUTO,
    *,
    plan: Plan | Mapping | str | os.PathLike | None = None,
    force_tiers: Mapping[str, str] | None = None,
    model_dir: str | Path | None = None,
    device: str | torch.device | None = None,
    prefetch: bool = True,
    backend=None,
    fallback: str | None = None,
    precision: str | None = None,
    stage: str | None = None,
    activation_bytes: int | None = None,
    parts: Mapping[str, tuple[str, ...]] | None = None,
    dtype: torch.dtype | None = None,
    skip: Collection[str] = (),
    phases: Sequence[str] = (),
    host_tiers: "KeptHostTiers | None" = None,
):
    """Apply a plan to the live pipeline ``pipe`` and return the same object.

    budget:      "auto" (default; None alike) detects what is free now (memfit.plan.budget.resolve_budget);
                 bytes, "6GiB", or Budget(device=, host=, disk=), refused above the container's or
                 device's total; "none" places nothing (only ``backend`` then has work to do).
    plan:        an explicit plan instead of planning here, made for this pipeline: a Plan, a dict as
                 Plan.to_dict() or ``memfit plan --json`` writes it (the report, or its "plan"), or the
                 path of a .json file holding either (memfit.plan.planner.Plan.from_dict reads it).
    force_tiers: {pattern: "device"|"host"|"disk"}, patterns matched (fnmatch) against block keys
                 ("unet/down_blocks.0", "text_encoder/*", or a bare component name); later patterns
                 win; blocks matched by none stay on the device. For tests and experiments.
    model_dir:   the pipeline folder whose safetensors back the disk tier, when a component's
                 ``config._name_or_path`` does not point at its own folder.
    device:      execution device; default: where the pipeline's weights are now.
    stage:       plan all components as one stage of that name (they are resident together, as in
                 one stage of memfit.generate); default: one stage per group of components that run
                 together (text encoders; denoiser with a ControlNet; VAE; each other component alone).
    activation_bytes: the activation peak the plan reserves room for (one stage, or each); default: each
                 stage's estimate for the pipeline's default size with guidance, from its family's rules
                 (memfit.plan.activations; with memfit's margin on a GPU). Give bytes for another size, 0 for none.
    parts:       {component: module paths} for components the stage runs only part of ({"vae":
                 ("decoder", "rest")} for a text-to-image decode): only those blocks are planned; the
                 others are put on the disk tier, where they cost no memory unless something calls them.
    backend:     compile each component's entry points (memfit.compile.entry_points.compile_components): a name,
                 a Backend, or {component: backend}. Alone (no budget/plan/force_tiers) it only
                 compiles and places nothing. ``fallback="eager"`` runs a failing component eagerly;
                 the records are in ``pipe._memfit_compile_records``. ``precision`` ("fp32", "bf16",
                 "fp16") is the compute precision of a backend that has its own (memfit.compile.precision).
    dtype:       the dtype floating weights run in, for a pipeline loaded in its files' dtype
                 (memfit.models.folder.ModelFolder.load_stage's ``in_file_dtype``): planned at this dtype;
                 resident weights are converted block by block, streamed ones at each forward. CPU only.
    skip:        components, or blocks ("unet/up_blocks.1.resnets.0"), left exactly as they are, outside the
                 plan (those a compiled model serves; a given plan may still place them: it counts their
                 compiled models as it would their weights).
    phases:      with ``stage``: components of which only one runs at a time, in the order they run (Wan 2.2's
                 experts, PipelineAdapter.experts). Each is planned apart, as a stage "STAGE:COMPONENT" with
                 the stage's other components, so the stage needs the largest, not their sum. The first is
                 placed now; each later one is brought in when it is first called, and the one before is
                 released to its home first (memfit.run.offload.Phases). On the CPU every block of a phase
                 component has its file as home, so a released one holds no memory.
    host_tiers:  on a device with memory of its own, where the pinned host tier goes when the pipeline is
                 restored or dropped, and where a later optimize of the same blocks takes it back filled
                 (KeptHostTiers: a Session keeps one between runs).
    """
    plan = _saved_plan(plan)
    no_budget = isinstance(budget, str) and budget.strip().lower() == NONE
    if plan is not None or force_tiers is not None:
        if not _is_auto(budget) and not no_budget:
            raise MemfitError("Pass at most one of budget=, plan= and force_tiers=.")
        if plan is not None and force_tiers is not None:
            raise MemfitError("Pass at most one of budget=, plan= and force_tiers=.")
        budget = None
    elif no_budget:
        if backend is None:
            raise MemfitError('budget="none" leaves memfit.optimize nothing to do; give a budget ("auto", "6GiB") '
                              "or a backend to compile with.")
        return _compile(pipe, backend, fallback, precision)
    if is_optimized(pipe):
        raise MemfitError("This pipeline is already optimized; call memfit.restore(pipe) before optimizing it again.")
    components = {name: module for name, module in _components(pipe).items() if name not in skip}
    if not components:
        raise MemfitError(f"{type(pipe).__name__} has no torch module components to optimize.")
    device = runtime_for(device if device is not None else _first_param(next(iter(components.values()))).device)
    if not device.can_stream:
        raise MemfitError(f"memfit streams weights on 'cpu' and 'cuda' devices, not {device.name}: load the "
                          "pipeline whole (budget=\"none\") or give a budget that keeps every weight resident.")
    if dtype is not None and device.separate_memory:
        raise MemfitError(f"optimize(dtype=...) converts weights on the CPU only; load the pipeline in its run "
                          f"dtype to run it on {device.name}.")

    all_blocks = {name: live_blocks(name, module, dtype) for name, module in components.items()}
    blocks = {name: [b for b in found if b.key not in skip] for name, found in all_blocks.items()}
    unrun = unrun_blocks(blocks, parts)
    if activation_bytes is None:  # a given or forced plan is not fitted to a budget: nothing to reserve
        planned = plan is None and force_tiers is None
        activation_bytes = _estimated_activations(pipe, stage, dtype, device) if planned else 0
    phases = alternating(phases, components) if stage is not None else ()
    stages = _stage_inputs(_without(blocks, unrun), stage, activation_bytes, type(pipe).__name__, phases)
    if plan is None and force_tiers is not None:
        plan = _forced_plan(stages, force_tiers, staging_ring=device.separate_memory)
    elif plan is None:
        # optimize fits a pipeline already loaded: what it holds now is part of what the budget bounds.
        in_use = sum(block.bytes for component_blocks in blocks.values() for block in component_blocks)
        on_host = 0
        if device.separate_memory:  # only what is on the device already counts there
            on_device = sum(t.numel() * t.element_size() for module in components.values()
                            for t in _tensors(module) if device.owns(t))
            in_use, on_host = on_device, in_use - on_device
        auto = _is_auto(budget)
        resolved = resolve_budget(budget, device, in_use=in_use if auto else 0)
        # The pipeline is loaded already: on the CPU a block "parked on the host" stays where it is; on a GPU
        # an automatic budget's host tier takes the place of the weights in host RAM now.
        plan = make_plan(stages, stage_budget(resolved.budget, device, loaded=auto, host_in_use=on_host if auto else 0),
                         staging_ring=device.separate_memory)
    tiers = _tiers_from_plan(plan, all_blocks, alternating=bool(phases))
    tiers.update((block.key, Tier.DISK) for block in unrun)
    # A phase component's blocks all get a home to go back to; those its phase keeps resident are pinned
    # while it runs. On the CPU the home is the file (the host tier would leave them where they are).
    to_pin = {block.key for name in phases for block in blocks[name] if tiers.get(block.key) == Tier.DEVICE}
    for name in phases:
        for block in blocks[name]:
            if block.key in to_pin or not device.separate_memory:
                tiers[block.key] = Tier.DISK if not device.separate_memory else _home(plan, block.key)

    # The hooks' shared state, around the device runtime: at most the plan's window of streamed
    # blocks on the device at once (the one running and those copied in ahead of it).
    runtime = Runtime(device, prefetch=prefetch, window=1 + plan.prefetch if prefetch else 1)
    unrun_keys = {block.key for block in unrun}
    streams_from_disk = any(tier == Tier.DISK for key, tier in tiers.items() if key not in unrun_keys)
    state = _State(runtime=runtime, slots=[], hooked=[], dtype=dtype, unrun=unrun,
                   own_resident=streams_from_disk and not device.separate_memory)
    # A pipeline dropped without restore (a staged run's finished stage) gives its pinned memory
    # back when it is collected, once nothing reads it; restore gives it back at once (and empties the list).
    weakref.finalize(state, _release_arenas, runtime.prefetches, state.arenas, state.kept)
    try:
        # A pipeline loaded in inference mode gets its new tensors made in it, whatever mode optimize runs in.
        with inference_mode_for(t for module in components.values() for t in module.parameters()):
            resident = []  # the blocks the stage runs that have nothing to swap in
            pinned: dict[str, list[SwapHook]] = {}
            if phases:
                state.phases = Phases([pinned.setdefault(name, []) for name in phases])
            for name, module in components.items():
                if name in phases:  # before the component's own hooks: its phase is entered first
                    HookRegistry.of(module).register(PhaseSwitch(state.phases, phases.index(name)))
                    state.switched.append(module)
                hooks = _apply_component(name, module, blocks[name], tiers, state, model_dir)
                if name in phases:
                    pinned[name] += [hook for block, found in zip(blocks[name], hooks) if block.key in to_pin
                                     for hook in found]
                placed = [(block, found) for block, found in zip(blocks[name], hooks) if block.key not in unrun_keys]
                # the order to read ahead in before the blocks have run
                runtime.plan_order([hook for _, found in placed for hook in found])
                resident += [block for block, found in placed if not found]
            _mark_resident(state, resident)
            _place_host_tier(state, host_tiers, stage)
            _make_staging_ring(state)
            _make_block_slots(state, kept={id(hook) for found in pinned.values() for hook in found})
            if state.phases is not None:
                state.phases.enter(0)
    except BaseException:
        _undo(state)
        raise
    object.__setattr__(pipe, STATE_ATTR, state)
    object.__setattr__(pipe, PLAN_ATTR, plan)
    try:
        if backend is not None:
            _compile(pipe, backend, fallback, precision)
        refuse_cuda_graphs_while_streaming(pipe)
    except BaseException:
        restore(pipe)
        raise
    return pipe


def _tensors(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def refuse_cuda_graphs_while_streaming(pipe) -> None:
    """Raise if a component of ``pipe`` whose weights stream is compiled with CUDA graphs: by memfit's
    backend, or by the user's own torch.compile (a module's ``.compile()`` or a torch.compile'd module)
    in a mode that captures them ("reduce-overhead", "max-autotune") over a streamed weight.

    A CUDA graph replays the addresses it captured, and a streamed block's weights are at new
    addresses on every forward (``param.data`` is swapped), so the replay would read freed memory.
    Called by optimize, after it placed the weights and compiled what it was asked to.
    """
    from memfit.compile.backends.inductor import refuse_cuda_graphs
    from memfit.compile.entry_points import ENTRIES_ATTR

    state = vars(pipe).get(STATE_ATTR)
    if state is None or not state.hooked or not state.runtime.separate_memory:
        return  # nothing streams, or on the CPU, where inductor captures no CUDA graph
    hooked = {id(module) for module in state.hooked}
    streamed = {id(slot.tensor) for slot in state.slots if slot.kind != SlotKind.DEVICE}
    for name, module in _components(pipe).items():
        if not any(id(sub) in hooked for sub in module.modules()):
            continue
        for method, entry in vars(module).get(ENTRIES_ATTR, {}).items():
            refuse_cuda_graphs(entry.backend, entry.options, f"{name}.{method}")
        for path, sub in module.named_modules():
            if _compiled_with_cuda_graphs(sub) and any(id(p) in streamed for p in sub.parameters()):
                raise MemfitError(
                    f"{'.'.join(filter(None, (name, path)))} is compiled with torch.compile in a mode that captures "
                    "CUDA graphs (mode='reduce-overhead' or 'max-autotune'), and its weights stream, which CUDA "
                    "graphs cannot follow; compile it with mode='max-autotune-no-cudagraphs' or the default mode, "
                    "or give a budget that keeps it resident.")


def _compiled_with_cuda_graphs(module: torch.nn.Module) -> bool:
    """Whether the user compiled ``module`` (``module.compile(...)``, or it is what torch.compile returned for
    a module) with inductor capturing CUDA graphs."""
    compiled = getattr(module, "_compiled_call_impl", None) or module
    config = getattr(compiled, "get_compiler_config", None)  # dynamo's, on what torch.compile returned
    options = config() if callable(config) else None
    return bool(options and options.get("triton.cudagraphs"))


def _is_auto(budget) -> bool:
    return budget is None or (isinstance(budget, str) and budget.strip().lower() == AUTO)


def plan_stage(pipe, budget: Budget, stage: str, activation_bytes: int = 0,
               parts: Mapping[str, tuple[str, ...]] | None = None, skip=(),
               dtype: torch.dtype | None = None, device: DeviceRuntime | None = None, phases: Sequence[str] = ()) -> Plan:
    """The plan ``optimize(pipe, stage=stage, activation_bytes=..., parts=...)`` would make under ``budget``, the
    stage's own (memfit.plan.budget.stage_budget); components named in ``skip`` are left out (optimize then
    leaves them as they are). ``dtype``: as optimize's. ``device``: the runtime it will run on (on a GPU the
    host figure counts the disk tier's staging ring); None: the CPU. ``phases``: as optimize's (a stage per phase)."""
    blocks = {name: live_blocks(name, module, dtype) for name, module in _components(pipe).items() if name not in skip}
    stages = _stage_inputs(_without(blocks, unrun_blocks(blocks, parts)), stage, activation_bytes, type(pipe).__name__,
                           alternating(phases, blocks))
    return make_plan(stages, budget, staging_ring=device is not None and device.separate_memory)


def blocks_not_run(pipe) -> list[LiveBlock]:
    """The blocks ``optimize(pipe, parts=...)`` left out of the plan and parked on the disk tier."""
    state = vars(pipe).get(STATE_ATTR)
    return list(state.unrun) if state is not None else []


def unrun_blocks(blocks: dict[str, list[LiveBlock]], parts: Mapping[str, tuple[str, ...]] | None) -> list[LiveBlock]:
    """The blocks outside ``parts`` (see optimize), which the stage does not run.

    A component none of whose blocks lies under its parts is run whole: a part name that matches
    nothing (another VAE class) must not park the weights the stage needs.
    """
    from memfit.plan.meta import is_under

    unrun = []
    for component, found in blocks.items():
        prefixes = (parts or {}).get(component)
        if not prefixes:
            continue
        outside = [b for b in found if not any(is_under(b.name, p) for p in prefixes)]
        if len(outside) < len(found):
            unrun += outside
    return unrun


def _without(blocks: dict[str, list[LiveBlock]], left_out: list[LiveBlock]) -> dict[str, list[LiveBlock]]:
    """``blocks`` less ``left_out``; a left-out block holding its component's anchor stays as the anchor
    alone (the executor keeps the anchor on the device whatever the block's tier, so the plan counts it)."""
    ids = {id(b) for b in left_out}
    return {name: [b if id(b) not in ids else dataclasses.replace(b, bytes=b.fixed_bytes, units=[])
                   for b in found if id(b) not in ids or b.fixed_bytes] for name, found in blocks.items()}


def _stage_inputs(blocks: dict[str, list[LiveBlock]], stage: str | None, activation_bytes: int | Callable[[str], int],
                  pipeline_class: str = "", phases: Sequence[str] = ()) -> list[StageInput]:
    """One stage named ``stage`` holding every component, or (no stage named) one stage per group of
    components that run together (memfit.models.families.run_together: the denoiser with a ControlNet,
    the text encoders together, the VAE alone), so each group fits the budget at once. ``activation_bytes``:
    every stage's, or a function of the stage's name. With ``phases`` (components that run one at a time, see
    optimize) the stage named is one stage per phase, "STAGE:COMPONENT", each with the other components."""
    from memfit.models.families import run_together

    estimate = activation_bytes if callable(activation_bytes) else lambda name: activation_bytes
    specs = {name: tuple(BlockSpec(b.component, b.name, b.bytes, b.fixed_bytes) for b in found)
             for name, found in blocks.items()}
    scratch = {name: max((b.scratch_bytes for b in found), default=0) for name, found in blocks.items()}

    def activations(name: str, members) -> int:  # one layer dequantizes at a time: the largest scratch
        return estimate(name) + max((scratch[member] for member in members), default=0)

    if stage is not None:
        return [StageInput(name, tuple(spec for member in members for spec in specs[member]), activations(stage, members),
                           homed=homed)
                for name, members, homed in phase_stages(stage, specs, phases)]
    return [StageInput(name, tuple(spec for member in members for spec in specs[member]), activations(name, members))
            for name, members in run_together(pipeline_class, specs)]


def _estimated_activations(pipe, stage: str | None, dtype: torch.dtype | None, device) -> Callable[[str], int]:
    """Each stage's activation estimate for ``pipe`` called at its default size with guidance (a batch of two):
    its family's rules (memfit.plan.activations), as a staged run plans them, times memfit's margin on a GPU.
    A stage of all components (``stage`` named) runs the pipeline's parts one after another."""
    from memfit.dtypes import dtype_name
    from memfit.models.families import adapter_for
    from memfit.models.families.base import Settings
    from memfit.plan.activations import DEVICE_ACTIVATION_MARGIN, stage_strategies

    configs, classes = {}, {}
    for name, value in getattr(pipe, "components", {}).items():
        config = getattr(value, "config", None)
        if config is not None:
            configs[name] = dict(config) if isinstance(config, Mapping) else config.to_dict()
        if value is not None:
            classes[name] = (type(value).__module__.split(".")[0], type(value).__name__)
    adapter = adapter_for(type(pipe).__name__, configs, classes)
    weights = next((p for m in _components(pipe).values() for p in m.parameters() if p.is_floating_point()), None)
    run_dtype = dtype_name(dtype or (weights.dtype if weights is not None else torch.float32))
    margin = DEVICE_ACTIVATION_MARGIN if device.separate_memory else 1.0

    def estimate(name: str) -> int:
        part = "pipeline" if stage is not None else name
        if part not in ("encode", "denoise", "decode", "pipeline"):
            return 0  # a component run on its own (an image encoder): no rule for it
        try:
            size = adapter.default_size()
            settings = Settings("", None, steps=1, guidance=7.5, seed=0, width=size, height=size)
            return int(stage_strategies(adapter, part, settings, True, run_dtype)[0].activation_bytes * margin)
        except KeyError:
            return 0  # components without the configs the rules read (modules that are not diffusers models)

    return estimate


def _compile(pipe, backend, fallback, precision=None):
    from memfit.compile.entry_points import compile_components

    records = compile_components(pipe, backend, fallback=fallback, precision=precision)
    object.__setattr__(pipe, COMPILE_RECORDS_ATTR, records)
    return pipe


def keep_dequantized(pipe, room: int | None, dtype: torch.dtype) -> int:
    """In the optimized ``pipe``, keep the weights of resident quantized layers (memfit.quant) dequantized in
    ``dtype``, in model order, while they add up to at most ``room`` bytes (None: no limit); the bytes kept.

    A quantized layer dequantizes its weight at every forward: a cost where its matmul is small (on a CPU at
    1024 tokens, about as much as the matmul). Where the budget has room, the stage runs as fast as with
    unquantized weights; where it has none, the weights stay in their stored bytes. restore drops them."""
    from memfit.quant.layers import StoredWeightLayer

    state = vars(pipe).get(STATE_ATTR)
    if state is None:
        return 0
    streamed = {id(slot.owner) for slot in state.slots if slot.kind != SlotKind.DEVICE and slot.name == "weight"}
    kept = 0
    for module in _components(pipe).values():
        for layer in module.modules():
            if not isinstance(layer, StoredWeightLayer) or id(layer) in streamed or layer.weight.device.type == "meta":
                continue
            nbytes = layer.dequantized_bytes(dtype)
            if room is not None and kept + nbytes > room:
                return kept
            layer.dequantized = layer.dequantize_weight(dtype)
            state.dequantized.append(layer)
            kept += nbytes
    return kept


def restore(pipe):
    """Remove every memfit hook and attribute from ``pipe`` and put every tensor back as it was
    (same objects, same values, dtype and device). Returns ``pipe``. A no-op on a plain pipeline."""
    if vars(pipe).pop(COMPILE_RECORDS_ATTR, None) is not None:
        from memfit.compile.entry_points import uncompile

        uncompile(pipe)
    state = vars(pipe).pop(STATE_ATTR, None)
    vars(pipe).pop(PLAN_ATTR, None)
    if state is not None:
        _undo(state)
    return pipe


# --- blocks -------------------------------------------------------------------------------------


def live_blocks(component: str, module: torch.nn.Module, dtype: torch.dtype | None = None) -> list[LiveBlock]:
    """Split a live component into blocks with meta.py's rule; sizes from the live tensors (floating
    ones at ``dtype``'s size when given: the dtype they will run in).

    Every tensor belongs to exactly one block (tied weights to the first); order is registration
    order, as in meta.py.
    """
    from memfit.plan.meta import DEFAULT_MAX_BLOCK_FRACTION, DirectTensors, split_blocks

    names = {id(t): n for n, t in module.named_parameters()}
    names.update({id(t): n for n, t in module.named_buffers()})
    threshold = max(1, int(sum(p.numel() for p in module.parameters()) * DEFAULT_MAX_BLOCK_FRACTION))
    seen: set[int] = set()
    anchor = _first_param(module)
    in_memory = in_memory_only(module)  # tensors in no file stay where they are, like the anchor: counted so
    floating = next((p for p in module.parameters() if p.is_floating_point()), None)
    compute_dtype = dtype or (floating.dtype if floating is not None else torch.float32)
    out = []
    for block_name, members in split_blocks(module, "", threshold):
        units, size, fixed, scratch = [], 0, 0, 0
        for member in members:
            if isinstance(member, DirectTensors):
                hooked = member.module
                owned = [(hooked, n, t, True) for n, t in hooked.named_parameters(recurse=False)]
                owned += [(hooked, n, t, False) for n, t in hooked.named_buffers(recurse=False)]
            else:
                hooked = member
                owned = []
                for sub in member.modules():
                    owned += [(sub, n, t, True) for n, t in sub.named_parameters(recurse=False)]
                    owned += [(sub, n, t, False) for n, t in sub.named_buffers(recurse=False)]
            tensors = []
            for owner, attr, tensor, is_param in owned:
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                nbytes = tensor.numel() * _run_dtype(tensor, dtype).itemsize
                size += nbytes
                scratch = max(scratch, dequantized_elements(tensor) * compute_dtype.itemsize)
                if tensor is anchor or names.get(id(tensor)) in in_memory:
                    fixed += nbytes
                tensors.append((owner, attr, tensor, is_param, names.get(id(tensor), attr)))
            if tensors:
                units.append((hooked, tensors))
        out.append(LiveBlock(component, block_name, size, units, fixed, scratch))
    return out


def _components(pipe) -> dict[str, torch.nn.Module]:
    out, seen = {}, set()
    for name, value in getattr(pipe, "components", {}).items():
        if isinstance(value, torch.nn.Module) and id(value) not in seen and _first_param(value) is not None:
            seen.add(id(value))  # a component shared under two names is placed once
            out[name] = value
    return out


def _first_param(module):
    return next(iter(module.parameters()), None)


# --- plans --------------------------------------------------------------------------------------


def _saved_plan(plan) -> Plan | None:
    """optimize's ``plan=`` as a Plan (None stays None)."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan)
    if not isinstance(plan, (str, os.PathLike)):
        raise MemfitError(f"plan= takes a memfit Plan, a dict as `memfit plan --json` writes it, or the path of such "
                          f"a .json file; got {type(plan).__name__} {plan!r}.")
    path = Path(plan)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise MemfitError(f"Cannot read the plan {path}: {exc.strerror or exc}; give the .json file that "
                          "`memfit plan ... --json` wrote.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MemfitError(f"The plan {path} is not JSON ({exc}); give the file that `memfit plan ... --json` "
                          "wrote.") from None
    try:
        return Plan.from_dict(data)
    except MemfitError as exc:
        raise MemfitError(f"{path}: {exc}") from None


def _forced_plan(stages: list[StageInput], force_tiers: Mapping[str, str], staging_ring: bool) -> Plan:
    from memfit.plan.planner import host_need, stage_plan, staging_ring_bytes

    forced: dict[str, Tier] = {}
    for pattern, tier in force_tiers.items():
        try:
            forced[pattern] = Tier(tier)
        except ValueError:
            raise MemfitError(f"force_tiers[{pattern!r}] is {tier!r}; use one of {', '.join(Tier)}.") from None
    wanted: dict[str, Tier] = {}
    for stage in stages:
        for block in stage.blocks:
            wanted[block.key] = Tier.DEVICE
            for pattern, tier in forced.items():
                if fnmatch.fnmatchcase(block.key, pattern) or block.component == pattern:
                    wanted[block.key] = tier
    unmatched = [p for p in force_tiers if not any(fnmatch.fnmatchcase(k, p) or k.split("/")[0] == p for k in wanted)]
    if unmatched:
        raise MemfitError(f"force_tiers pattern(s) {unmatched} match no block; keys look like {next(iter(wanted))!r}.")
    resident = [frozenset(b.key for b in s.blocks if wanted[b.key] == Tier.DEVICE) for s in stages]
    homes = {key: (Tier.DISK if tier == Tier.DISK else Tier.HOST) for key, tier in wanted.items()}
    stage_plans = tuple(stage_plan(s, r, homes, 1) for s, r in zip(stages, resident))
    sizes = {b.key: b.bytes for s in stages for b in s.blocks}
    host_keys = [k for k, h in homes.items() if h == Tier.HOST]
    return Plan(
        budget=Budget(),
        prefetch=1,
        stages=stage_plans,
        homes=tuple(homes.items()),
        host_peak_bytes=host_need(host_keys, sizes, resident)
        + (staging_ring_bytes(stage_plans, 1) if staging_ring else 0),
    )


def _home(plan: Plan, key: str) -> Tier:
    return plan.home_of(key) if any(block == key for block, _ in plan.homes) else Tier.HOST


def _tiers_from_plan(plan: Plan, blocks: dict[str, list[LiveBlock]], alternating: bool = False) -> dict[str, Tier]:
    """One tier per block: Tier.DEVICE where any stage keeps it resident, else its home. ``alternating``: the
    plan's stages are phases of one stage (optimize's ``phases``), and a block that several of them run is
    resident only where every one of them keeps it so (the phases' peaks only fall)."""
    live = {b.key for component_blocks in blocks.values() for b in component_blocks}
    tiers: dict[str, Tier] = {}
    unknown = []
    for stage in plan.stages:
        for p in stage.placements:
            key = f"{p.component}/{p.block}"
            if key not in live:
                unknown.append(key)
            elif alternating and key in tiers and (tiers[key] == Tier.DEVICE) != (p.where == Tier.DEVICE):
                tiers[key] = plan.home_of(key)
            elif p.where == Tier.DEVICE or tiers.get(key) == Tier.DEVICE:
                tiers[key] = Tier.DEVICE
            else:
                tiers[key] = p.where
    if unknown:
        raise MemfitError(
            f"The plan names block(s) this pipeline does not have, e.g. {unknown[0]!r}; make the plan for "
            f"this pipeline (its blocks look like {sorted(live)[0]!r})."
        )
    return tiers


# --- applying -----------------------------------------------------------------------------------


def _run_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _apply_component(name, module, component_blocks, tiers, state: _State, model_dir) -> list[list[SwapHook]]:
    """Place the tensors of ``component_blocks``; returns each block's SwapHooks (none where it stays resident)."""
    runtime = state.runtime
    anchor = _first_param(module)
    # Tensors a single-file conversion computed are in no file: like the anchor they stay where they are.
    fixed = in_memory_only(module)
    opened: list = []  # [WeightSource or None] once the component's files were looked for

    def source_files(required: bool) -> WeightSource | None:
        if not opened or (required and opened[0] is None):
            try:
                opened[:] = [weight_source(name, module, model_dir)]
            except MemfitError:
                if required:
                    raise
                opened[:] = [None]  # no files: the loaded tensors are the only source
        return opened[0]

    _prefetch_disk_tier_samples(component_blocks, tiers, anchor, fixed, source_files)
    hooks = []
    for block in component_blocks:
        tier = tiers.get(block.key, Tier.DEVICE)
        hooks.append([])
        for hooked, tensors in block.units:
            slots = []
            for owner, attr, tensor, is_param, full_name in tensors:
                separate = runtime.separate_memory
                run_dtype = _run_dtype(tensor, state.dtype)
                kept = tensor is anchor or full_name in fixed
                if separate and (tier == Tier.DEVICE or kept) and not runtime.device_runtime.owns(tensor):
                    slot = Slot(owner, attr, tensor, home=None, kind=SlotKind.DEVICE)
                    tensor.data = runtime.device_runtime.to_device(tensor.data)
                    state.slots.append(slot)
                    continue
                if tier == Tier.DISK and is_param and is_adapter_weight(full_name):
                    tier_of_tensor = Tier.HOST  # a LoRA's own tensor is in no model file: it stays in memory
                else:
                    tier_of_tensor = tier
                if tier_of_tensor == Tier.DEVICE or kept or (
                        not separate and (tier_of_tensor == Tier.HOST or not is_param)):
                    # On the CPU host RAM is the device: the tensor stays where it is (module.dtype and
                    # module.device read the anchor: see the module docstring), in its run dtype.
                    if run_dtype != tensor.dtype or (state.own_resident and is_param):
                        _own_memory(tensor, run_dtype, full_name, source_files(required=False))
                    continue
                if tier_of_tensor == Tier.DISK and is_param:
                    mapped = _checked_mapping(source_files(required=True), name, full_name, tensor)
                    slot = Slot(owner, attr, tensor, home=mapped, kind=SlotKind.MMAP, dtype=run_dtype)
                    state.slots.append(slot)
                    # The hook converts / copies it for each forward, or (same dtype, CPU) reads it
                    # ahead and drops its pages from this process after the block ran.
                    slots.append(slot)
                    tensor.data = mapped.tensor  # outside a forward the weight IS the mapped file
                    if mapped.pages is not None:
                        mapped.pages.release()  # the check above read every page
                    continue
                # host tier on a GPU (or a buffer of a disk block): its home is a place in the stage's
                # pinned arena, filled by _place_host_tier once every such tensor is known.
                files = source_files(required=False)
                slot = Slot(owner, attr, tensor, home=None, kind=SlotKind.HOST)
                source = None
                if files is not None and not is_adapter_weight(full_name):
                    source = _file_view(files, full_name, tensor)
                state.host_sources.append((slot, source))
                state.slots.append(slot)
                slots.append(slot)
            if slots:
                hook = SwapHook(block.key, slots, runtime)
                HookRegistry.of(hooked).register(hook)
                state.hooked.append(hooked)
                hooks[-1].append(hook)
    return hooks


def _prefetch_disk_tier_samples(component_blocks, tiers, anchor, fixed, source_files) -> None:
    """Ask the kernel to read ahead the samples _checked_mapping compares for every weight placed on the disk tier,
    before any is checked: the reads then overlap instead of waiting for one at a time (with the
    page cache evicted, as a capped run finds it, these waits were most of a check's time)."""
    files = None
    for block in component_blocks:
        if tiers.get(block.key, Tier.DEVICE) != Tier.DISK:
            continue
        for _, tensors in block.units:
            for _, _, tensor, is_param, full_name in tensors:
                if not is_param or tensor is anchor or full_name in fixed or is_adapter_weight(full_name):
                    continue
                files = files or source_files(required=False)
                if files is None:
                    return  # no files: placing the block raises, naming them
                mapped = files.find(_stored_name(full_name))
                if mapped is not None and mapped.pages is not None and mapped.tensor.is_contiguous():
                    mapped.pages.prefetch_samples(mapped.tensor.numel(), mapped.tensor.element_size())


def _mark_resident(state: _State, resident: list[LiveBlock]) -> None:
    """Put a ResidentHook on the ``resident`` blocks where blocks stream to a device of their own with
    prefetch: the copies of the streamed blocks after a resident run then start as it starts."""
    runtime = state.runtime
    if not (state.hooked and runtime.separate_memory and runtime.prefetch):
        return
    for block in resident:
        for hooked, _ in block.units:
            registry = HookRegistry.of(hooked)
            if ResidentHook.name not in registry.hooks:  # a module the units of two blocks share
                registry.register(ResidentHook(runtime))
                state.marked.append(hooked)


def _own_memory(tensor: torch.Tensor, dtype: torch.dtype, full_name: str, files: WeightSource | None) -> None:
    """Give a resident weight memory of its own in its run dtype, read from memfit's own mapping of its
    file where it is there, whose pages then leave this process.

    Two cases. Loaded in its file's dtype: converting block by block holds the converted blocks and
    one block of the file, never the model twice. Loaded as a view of its file (same dtype) in a
    stage that streams from disk: a view is page cache, which the kernel reclaims like the streamed
    blocks' pages, so under a cap the "resident" weights would be read again at every step; in the
    process's own memory they stay (the plan counts them either way).
    """
    source = None
    if files is not None and not is_adapter_weight(full_name):
        # Read ahead before the check: it then compares pages this one large read brings in, rather than
        # waiting for reads of its own (the page cache of a capped run's files is mostly evicted).
        source = _file_view(files, full_name, tensor, before_check=_prefetch)
    if source is None:
        if dtype != tensor.dtype:
            tensor.data = tensor.data.to(dtype)
        return  # not from a file: already the process's own memory
    tensor.data = source.tensor.to(dtype, copy=True)
    if source.pages is not None:
        source.pages.release()


def _place_host_tier(state: _State, host_tiers: "KeptHostTiers | None", stage: str | None) -> None:
    """Put every host-tier tensor of the stage into ONE pinned arena of exactly their aligned sizes.

    One arena, not one pinned buffer per tensor: a pinned allocator rounds each request up (to a
    power of two in torch's), so per-tensor buffers take up to twice what the plan counts. Values
    are read from the model's memory-mapped file where the weight is there (no detour through
    the loaded copy, wherever that lives), else from the loaded tensor. With ``host_tiers``, an arena
    kept there holding exactly these tensors of the same files is taken back as it is, and this one
    goes there when the pipeline is let go (only where every tensor is read from a file: the
    contents are then known from the files alone).
    """
    if not state.host_sources:
        return
    device = state.runtime.device_runtime
    sizes = [slot.tensor.numel() * slot.tensor.element_size() for slot, _ in state.host_sources]
    total = sum(aligned(n) for n in sizes)
    contents = None if host_tiers is None else _host_tier_contents(state.host_sources)
    arena = None if contents is None else host_tiers.take(contents)
    filled = arena is not None
    if arena is None:
        if host_tiers is not None:
            host_tiers.make_room(total)
        arena = device.pinned_arena(total)
    state.arenas.append(arena)
    if contents is not None:
        state.kept.append((arena, contents, stage, host_tiers))
    state.host_tier_reused = total if filled else 0
    offset = 0
    for (slot, source), nbytes in zip(state.host_sources, sizes):
        tensor = slot.tensor
        home = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        offset += aligned(nbytes)
        if not filled:
            home.copy_(source.tensor if source is not None else tensor.data)
        if source is not None and source.pages is not None:
            source.pages.release()
        slot.home = home
        tensor.data = home
    state.host_sources.clear()


def _host_tier_contents(host_sources: list) -> tuple | None:
    """What a host-tier arena of ``host_sources`` holds, as a key: per tensor its run dtype and shape and the
    file bytes it is read from, with each file's size, modification time and inode (a file changed in place
    is another key); None where a tensor is not read from a file."""
    files: dict[str, tuple] = {}
    contents = []
    for slot, source in host_sources:
        if source is None or source.origin is None:
            return None
        path = source.origin[0]
        if path not in files:
            try:
                stat = os.stat(path)
            except OSError:
                return None
            files[path] = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        contents.append((str(slot.tensor.dtype), tuple(slot.tensor.shape), source.origin, files[path]))
    return tuple(contents)


class KeptHostTiers:
    """Pinned host tiers kept filled between runs on a device with memory of its own (a Session's pool keeps
    one), so that the next optimize of the same blocks neither page-locks nor reads them again (for Flux at
    a quarter resident, 18 GB each run).

    An arena is kept under the key of what it holds (_host_tier_contents) when the pipeline holding it is
    restored or dropped, and taken back by an optimize that would fill one with the same contents. One is
    kept per stage: the latest (a server's requests of other sizes plan other tiers; the ones before are
    given back). Kept arenas hold host RAM the stages' plans count as free (``nbytes``): before a new arena
    is page-locked, the oldest kept ones are given back until the host has room for it (``make_room``).
    """

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[torch.Tensor, DeviceRuntime, str | None]] = {}  # oldest first
        self._lock = threading.Lock()

    def take(self, contents: tuple) -> torch.Tensor | None:
        with self._lock:
            found = self._kept.pop(contents, None)
        return None if found is None else found[0]

    def keep(self, contents: tuple, arena: torch.Tensor, device: DeviceRuntime, stage: str | None) -> None:
        with self._lock:
            replaced = [key for key, (_, _, kept_for) in self._kept.items() if key == contents or kept_for == stage]
            released = [self._kept.pop(key) for key in replaced]
            self._kept[contents] = (arena, device, stage)
        for old, old_device, _ in released:
            old_device.release_arena(old)

    def nbytes(self) -> int:
        """The bytes kept now: host RAM the plans may count as free."""
        with self._lock:
            return sum(arena.numel() for arena, _, _ in self._kept.values())

    def make_room(self, nbytes: int) -> None:
        """Give back the oldest kept arenas until ``nbytes`` more fit in the host's available RAM (less
        memfit's host reserve)."""
        from memfit.plan.budget import host_reserve, read_host_memory  # looked up at the call: tests stand one in

        while True:
            host = read_host_memory()
            if host.available - host_reserve(host.total or host.available) >= nbytes:
                return
            with self._lock:
                if not self._kept:
                    return
                arena, device, _ = self._kept.pop(next(iter(self._kept)))
            device.release_arena(arena)
            del arena

    def clear(self) -> None:
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for arena, device, _ in kept:
            device.release_arena(arena)


def _make_staging_ring(state: _State) -> None:
    """The pinned ring the disk tier passes through on a device with its own memory: one slot per
    block of the streaming window, each as large as the largest disk-tier block in its file dtype."""
    runtime = state.runtime
    if not runtime.separate_memory:
        return
    largest = 0
    for module in state.hooked:
        hook = HookRegistry.get(module).hooks[SwapHook.name]
        homes = [slot.home_tensor() for slot in hook.slots if slot.kind == SlotKind.MMAP]
        largest = max(largest, sum(aligned(h.numel() * h.element_size()) for h in homes))
    if largest:
        runtime.ring = StagingRing(runtime.device_runtime, largest, runtime.window)
        state.arenas.append(runtime.ring.arena)


def _make_block_slots(state: _State, kept: Collection[int]) -> None:
    """The device memory streamed blocks run in on a device with memory of its own (BlockSlots): one slot per
    block of the streaming window, as large as the largest streamed blocks, whose sum the plan counts as the
    window. ``kept``: the hooks (by id) a phase keeps resident while it runs, which take no slot; nor do the
    blocks the stage does not run (parked on disk, outside the plan: one called anyway takes a free slot it
    fits, else memory of its own)."""
    runtime = state.runtime
    if not runtime.separate_memory:
        return
    unrun = {id(module) for block in state.unrun for module, _ in block.units}
    hooks = [HookRegistry.get(module).hooks[SwapHook.name] for module in state.hooked if id(module) not in unrun]
    sizes = sorted((hook.run_bytes for hook in hooks if id(hook) not in kept), reverse=True)[:runtime.window]
    if sizes:
        runtime.use_slots(BlockSlots(runtime.device_runtime, sizes))


def _file_view(files: WeightSource, full_name: str, tensor, before_check=None) -> Shared | None:
    """The mapped file's copy of ``tensor`` when the file holds exactly this weight, else None."""
    try:
        return _checked_mapping(files, "", full_name, tensor, before_check)
    except MemfitError:
        return None


def _prefetch(mapped: Shared) -> None:
    if mapped.pages is not None:
        mapped.pages.prefetch()  # one large read instead of a page fault at a time


def is_adapter_weight(full_name: str) -> bool:
    """Whether a parameter is a LoRA's own tensor (PEFT's lora_A / lora_B ...), which no model file holds."""
    from memfit.models.lora import ADAPTER_PARAMETER_NAMES

    return any(part in ADAPTER_PARAMETER_NAMES for part in full_name.split("."))


def _stored_name(full_name: str) -> str:
    # A layer with a LoRA (PEFT) keeps the original layer as ``base_layer``; its weights are the file's.
    return ".".join(part for part in full_name.split(".") if part != "base_layer")


def _checked_mapping(files: WeightSource, component: str, full_name: str, tensor, before_check=None) -> Shared:
    """``full_name``'s view of its file, checked against the loaded ``tensor``; ``before_check(view)`` is called
    first where given (to read the view ahead)."""
    full_name = _stored_name(full_name)
    mapped = files.find(full_name)
    if mapped is not None and before_check is not None:
        before_check(mapped)
    if mapped is None:
        raise MemfitError(
            f"{component}.{full_name} is not in the safetensors of {files.where}, so it cannot be read "
            "from disk; keep this block on the host tier or save the pipeline again."
        )
    view = mapped.tensor
    if tuple(view.shape) != tuple(tensor.shape) or not same_samples(view, tensor.data):
        raise MemfitError(
            f"{component}.{full_name} differs from its copy in {files.where} (was the model changed after "
            "loading, e.g. a fused LoRA?). The disk tier would run the file's weights; save the pipeline "
            "and load it again, or keep this block off the disk tier."
        )
    return mapped


def _undo(state: _State) -> None:
    if state.phases is not None:
        state.phases.leave()
    for module in state.switched:
        registry = HookRegistry.get(module)
        if registry is not None:
            registry.remove(PhaseSwitch.name)
    state.switched.clear()
    for layer in state.dequantized:
        layer.dequantized = None
    state.dequantized.clear()
    for modules, name in ((state.hooked, SwapHook.name), (state.marked, ResidentHook.name)):
        for module in modules:
            registry = HookRegistry.get(module)
            if registry is not None:
                registry.remove(name)
    state.runtime.close()
    with inference_mode_for(slot.tensor for slot in state.slots):
        _put_back(state.slots)
    state.slots.clear()
    state.hooked.clear()
    state.marked.clear()
    _release_arenas(state.runtime.prefetches, state.arenas, state.kept)


def _put_back(slots: list[Slot]) -> None:
    for slot in reversed(slots):
        kind = slot.kind
        if kind == SlotKind.DEVICE:
            data = slot.tensor.data.to(slot.device, copy=True)
        elif kind == SlotKind.HOST:
            data = slot.home_tensor().to(device=slot.device, dtype=slot.dtype, copy=True)  # out of the arena
        else:
            data = slot.home_tensor().to(device=slot.device, dtype=slot.dtype)
            if kind == SlotKind.MMAP and data.data_ptr() == slot.home_tensor().data_ptr():
                data = data.clone()  # restore an owned tensor, not a view of the mapped file
        slot.tensor.data = data


def _release_arenas(prefetches: Prefetches, arenas: list, kept: list) -> None:
    """Give ``arenas`` back to the device once no read or copy from them is under way; those in ``kept``
    ((arena, contents, stage, KeptHostTiers)) go to their KeptHostTiers instead."""
    if arenas:
        prefetches.settle()
    keepers = {id(arena): (contents, stage, host_tiers) for arena, contents, stage, host_tiers in kept}
    kept.clear()
    while arenas:
        arena = arenas.pop()
        if id(arena) in keepers:
            contents, stage, host_tiers = keepers[id(arena)]
            host_tiers.keep(contents, arena, prefetches.device, stage)
        else:
            prefetches.device.release_arena(arena)
