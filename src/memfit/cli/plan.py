"""``memfit plan``: show where every weight would live under a budget, without loading any weights.

    memfit plan --arch sdxl --budget 4GiB
    memfit plan --model ./sdxl-base --budget 6GiB --host 16GiB --json
    memfit plan --model ./flux-dev          # budget auto: what this machine can spare now

With no --budget (or --budget auto) the budget is what this machine (its container, its GPU) can
spare now, as a run would detect it; the output's first line says where it came from. An explicit
budget is not checked against this machine's size: plan for any machine (--device cpu or cuda, by
default this machine's).

A plan is made as `memfit generate` makes it, so both give the same verdict and the same numbers:
the memory a memfit process holds before any weight (Python, torch, the libraries: measured here,
or --process-memory) is counted in the budget, a budget below the run's floor is refused with the
same message, and on the CPU whatever is not resident streams from the model's own files (no host
tier), as a run streams it.

The architecture comes from a built-in config (archs.py) or from a diffusers folder's
model_index.json plus each component's config.json; meta.py sizes it, planner.py places it. Each
stage's activation strategy is chosen the way a run chooses it (memfit.plan.activations.choose): the
banded VAE decode as soon as the plain one would push a weight off the device, split guidance
passes only when the batched pass cannot be planned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

from memfit.cli.run_args import (COMPONENT_HELP, CONFIG_HELP, QUANTIZE_HELP, check_budget, check_model_args,
                                 parse_components, parse_quantize)
from memfit.errors import MemfitError
from memfit.models.archs import ARCHS, get_arch
from memfit.plan.budget import AUTO, Budget, BudgetTooSmall, stage_budget
from memfit.plan.planner import Plan, make_plan
from memfit.plan.stages import (DEFAULT_STEPS, choose_strategies, default_frames, planned_models,
                                planned_with_heap_where_it_fits, stage_options)
from memfit.run.libraries import quiet_libraries
from memfit.sizes import format_bytes, parse_size

__all__ = ["register", "run_plan"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``subparsers``; it sets ``func=run_plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="show where each weight would live under a memory budget (no weights needed)",
        description=(
            "Size a pipeline on the meta device and print which blocks stay on the device, which "
            "stream from host RAM and which from disk, with the predicted peak per stage."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--arch", choices=sorted(ARCHS), type=str.lower, help="a built-in architecture")
    source.add_argument("--model", metavar="PATH", help="a diffusers pipeline folder (reads only JSON configs), or an "
                        "all-in-one checkpoint file (reads only its header and its configs)")
    parser.add_argument("--config", metavar="DIR", help=CONFIG_HELP)
    parser.add_argument("--component", action="append", metavar="NAME=FILE", help=COMPONENT_HELP)
    parser.add_argument("--quantize", action="append", metavar="NAME=TYPE", help=QUANTIZE_HELP)
    parser.add_argument("--budget", default="auto", help="device memory budget, e.g. 4GiB, 6GB (=6*10^9), 512MiB; "
                        "auto (default): what this machine can spare now; +SIZE: SIZE on top of the memory this process "
                        "holds, as memfit generate takes it")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="the device to plan for (default: this machine's, "
                        "as memfit generate picks it)")
    parser.add_argument("--process-memory", metavar="SIZE", help="what a memfit process holds before any weight "
                        "(Python, torch, the libraries), counted in the budget as a run counts it; default: measured "
                        "here (on a GPU: 0, a run's device starts empty)")
    parser.add_argument("--host", help="on a GPU: host RAM for weights parked off the device (default: what this "
                        "machine has available, or unlimited where it has no GPU)")
    parser.add_argument("--disk", metavar="DIR", help="directory for memory-mapped weights (enables the disk tier)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="weight dtype (default fp32, as memfit generate)")
    parser.add_argument("--width", type=int, help="image width in pixels (default: the model's native size)")
    parser.add_argument("--height", type=int, help="image height in pixels (default: the model's native size)")
    parser.add_argument("--frames", type=int, help="a video's frames (num_frames; default: the pipeline's, e.g. "
                        "Wan's 81): the decode's activations grow with them")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="denoising steps (decides host vs disk)")
    parser.add_argument("--prefetch", type=int, default=1, help="blocks copied ahead while one runs (default 1)")
    parser.add_argument("--precision", metavar="{fp32,bf16,fp16}",
                        help="say what a backend's compute precision (memfit generate --precision) changes")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan for ``args`` (see ``register``); return the exit code. Raises MemfitError."""
    check_budget(args.budget)
    check_model_args(args)
    quiet_libraries()
    name, description, adapter = _source(args)
    default_width, default_height = _default_size(adapter)
    width = args.width or default_width
    height = args.height or default_height
    if width <= 0 or height <= 0 or args.steps <= 0:
        raise MemfitError(f"--width, --height and --steps must be positive, got {width}, {height}, {args.steps}.")
    if args.frames is not None and (args.frames <= 0 or not adapter.makes_video):
        raise MemfitError(f"--frames is a video's frame count, a positive number; {adapter.class_name} makes "
                          f"{'videos' if adapter.makes_video else 'images'}: "
                          f"{'give at least 1' if adapter.makes_video else 'leave --frames out'}.")
    precision_line = None
    if args.precision is not None:
        from memfit.compile.precision import describe_precision

        precision_line = describe_precision(args.precision, args.dtype)
    from memfit.plan.budget import above_process_size
    from memfit.run.fit import check_budget_floor

    runtime = _runtime(args.device)
    on_top = above_process_size(args.budget) is not None  # "+SIZE": the process's memory is not in the budget
    held = _process_memory(args, runtime)
    budget, source = _budget(args, runtime, held)
    if budget.device is not None and str(args.budget).strip().lower() != "auto":
        # As memfit generate refuses an explicit budget below the run's floor: the same check, the same message.
        check_budget_floor(adapter, SimpleNamespace(width=width, height=height, steps=args.steps,
                                                    num_frames=args.frames), args.dtype,
                           budget, runtime, above_process=on_top, in_use=held)
    if on_top:
        held = 0
    room = _room(budget, runtime, held, _stream_from(args, runtime))
    # As a run plans: on the CPU with the denoising loop's heap counted where the budget has room for it.
    try:
        (options, strategies, plan), _ = planned_with_heap_where_it_fits(
            lambda heap_temporaries: _plan_stages(adapter, args, width, height, room,
                                                  heap_temporaries=heap_temporaries),
            heap_temporaries=not runtime.separate_memory)
    except BudgetTooSmall as exc:
        raise exc.counting(budget.device, held) if held else exc from None
    if str(args.budget).strip().lower() == AUTO and not runtime.separate_memory:
        plan = _with_decode_heap(options, strategies, plan, room, args.prefetch, adapter.configs.get("vae", {}),
                                 args.dtype)
    if args.json:
        extra = {"precision": precision_line} if precision_line else {}
        print(json.dumps({**_report(name, args.dtype, width, height, plan, strategies), "budget_source": source,
                          "device": runtime.name, "process_bytes": held, **extra}, indent=2))
    else:
        frames = f", {args.frames or default_frames(adapter)} frames" if adapter.makes_video else ""
        print(f"{name}: {description}; {width}x{height}{frames}, {args.dtype}, {args.steps} steps, on {runtime.name}")
        print(f"budget: {source}")
        if held:
            print(f"this process: {format_bytes(held)} before any weight (Python, torch, the libraries), counted in "
                  "the budget as a run counts it; the peaks below are the stages' own, on top of it")
        print(plan.table())
        for stage_options_, (stage, chosen) in zip(options, strategies.items()):
            if len(stage_options_) > 1:
                own = stage_options_[0][0]
                line = f"{stage}: {chosen.name}" + (" (the pipeline's own way)" if chosen.name == own.name else
                                                     f" instead of {own.name}, which would need "
                                                     f"{format_bytes(own.activation_bytes)} of activations")
                if chosen.tiling is not None:
                    line += f"; {chosen.tiling.describe()} (its output differs from an untiled decode's at the seams)"
                print(line)
        if precision_line:
            print(precision_line)
    return 0


def _default_size(adapter) -> tuple[int, int]:
    """(width, height) a run makes without --width/--height, as the family resolves it (a video's is not square:
    Wan's 832x480); the family's native square where it needs an input image to say (the editing families)."""
    try:
        settings = adapter.resolve("a prompt", None, None, None, 0, None, None)
    except MemfitError:
        return adapter.default_size(), adapter.default_size()
    return settings.width, settings.height


def _with_decode_heap(options, strategies, plan, room, prefetch: int, vae_config, dtype: str):
    """``plan`` with the plain decode's heap counted where a run takes its temporaries from the heap
    (memfit.run.fit._decodes_from_heap): an automatic budget on the CPU in which every stage keeps every weight
    its own way, a decode the heap speeds up, and room for the heap beside the decode's activations."""
    from memfit.plan.activations import StrategyKind, decode_gains_from_heap, decode_heap_slack

    chosen_options = list(zip(options, strategies.values()))
    if not all(chosen is stage_options_[0][0] for stage_options_, chosen in chosen_options) or _streams(plan):
        return plan
    plain, decode = options[-1][0]
    if plain.name != StrategyKind.PLAIN or not decode_gains_from_heap([option for option, _ in options[-1]],
                                                                       vae_config, dtype):
        return plan
    heaped = dataclasses.replace(decode, activation_bytes=decode.activation_bytes
                                 + decode_heap_slack(plain.activation_bytes))
    inputs = [stage_options_[0][1] for stage_options_, _ in chosen_options][:-1] + [heaped]
    try:
        with_heap = make_plan(inputs, room, prefetch=prefetch)
    except MemfitError:
        return plan
    return plan if _streams(with_heap) else with_heap


def _streams(plan) -> bool:
    return any(stage.streamed_from_host_bytes or stage.streamed_from_disk_bytes for stage in plan.stages)


def _plan_stages(adapter, args, width: int, height: int, room, *, heap_temporaries: bool):
    options = stage_options(adapter, dtype=args.dtype, width=width, height=height, steps=args.steps,
                            num_frames=args.frames, heap_temporaries=heap_temporaries)
    stages, strategies = choose_strategies(options, room, prefetch=args.prefetch)
    return options, strategies, make_plan(stages, room, prefetch=args.prefetch)


def _runtime(device: str | None):
    """The device to plan for, as a run's runtime; a GPU need not be here (plan for any machine)."""
    from memfit.devices import CpuRuntime, runtime_for
    from memfit.run.options import default_device

    if (device or default_device().type) == "cpu":
        return CpuRuntime()
    return runtime_for("cuda") if _gpu_here() else _PlannedGpu()


class _PlannedGpu:
    """A GPU planned for, present on this machine or not: memory of its own, streamed to, empty at first."""

    name = "cuda"
    separate_memory = True
    can_stream = True

    def memory_in_use(self) -> int:
        return 0


def _room(budget: Budget, runtime, held: int, stream_from: str | None) -> Budget:
    """What the stages' weights and activations get of ``budget``, by the rule a run follows
    (memfit.plan.budget.stage_budget). With no GPU here to read the host's RAM from, a planned GPU's
    host tier is --host, or unlimited."""
    from memfit.devices import CpuRuntime

    if isinstance(runtime, _PlannedGpu):
        limit = stage_budget(Budget(device=budget.device), CpuRuntime(), already_used=held).device
        return Budget(device=limit, host=budget.host, disk=budget.disk)
    return stage_budget(budget, runtime, already_used=held, stream_from=stream_from)


def _process_memory(args: argparse.Namespace, runtime) -> int:
    if args.process_memory is not None:
        return parse_size(args.process_memory)
    return runtime.memory_in_use()


def _stream_from(args: argparse.Namespace, runtime) -> str | None:
    """On the CPU a run streams what is not resident from the model's own files; so does its plan."""
    if runtime.separate_memory:
        return None
    return args.disk or args.model or "(the model's safetensors files)"


def _budget(args: argparse.Namespace, runtime, held: int) -> tuple[Budget, str]:
    """The budget to plan with and where it came from. auto: as a run on this machine detects it (what is
    free now and the ``held`` bytes this process holds). On a GPU with no --host, the host tier is what
    this machine has available (unlimited where it has no GPU)."""
    from memfit.plan.budget import above_process_size, resolve_budget

    if above_process_size(args.budget) is not None:
        budget = Budget(device=above_process_size(args.budget), host=args.host, disk=args.disk)
        return budget, f"explicit: +{format_bytes(budget.device)} on top of this process, as each stage starts"
    if str(args.budget).strip().lower() != AUTO:
        budget = Budget(device=args.budget, host=args.host, disk=args.disk)
        return budget, f"explicit: device {format_bytes(budget.device)}"
    if runtime.separate_memory and not _gpu_here():
        raise MemfitError("--budget auto detects what this machine can spare, and it has no GPU to plan --device cuda "
                          "for: give --budget SIZE (and --host SIZE) for the GPU you plan for.")
    resolved = resolve_budget(AUTO, runtime, in_use=held)
    detected = resolved.budget
    host = detected.host if args.host is None else args.host
    return Budget(device=detected.device, host=host, disk=args.disk), resolved.source


def _gpu_here() -> bool:
    from memfit.devices import cuda_device_count

    return cuda_device_count() > 0


def _source(args: argparse.Namespace):
    """(name, description, adapter) of the built-in architecture or the model folder asked for."""
    if (args.config is not None or args.component or args.quantize) and args.model is None:
        raise MemfitError("--config, --component and --quantize are for a model given as --model; --arch needs no "
                          "files.")
    if args.arch:
        arch = get_arch(args.arch)
        return arch.name, arch.description, arch.adapter()
    from memfit.models.model_path import open_model_path

    folder = open_model_path(args.model, config=args.config, components=parse_components(args.component),
                             quantize=parse_quantize(args.quantize), plan_only=True)
    adapter = folder.adapter
    planned = set(planned_models(adapter))
    folder.require_configs(planned)
    description = f"{folder.class_name} from {folder.path}"
    left_out = _models_left_out(adapter, planned)
    if left_out:
        description += f" (not planned: {', '.join(left_out)})"
    return folder.path.name or str(folder.path), description, adapter


def _models_left_out(adapter, planned: set[str]) -> list[str]:
    """Models of the folder that no stage of a text-to-image run uses (safety checker, image encoder)."""
    from memfit.plan.meta import is_model_class

    return [f"{name} ({class_name})" for name, (library, class_name) in adapter.classes.items()
            if name not in planned and is_model_class(library, class_name)]


def _report(name: str, dtype: str, width: int, height: int, plan: Plan, strategies: dict) -> dict[str, Any]:
    tilings = {stage: strategy.tiling.enable_kwargs for stage, strategy in strategies.items() if strategy.tiling}
    return {"arch": name, "dtype": dtype, "width": width, "height": height,
            "strategies": {stage: str(strategy.name) for stage, strategy in strategies.items()},
            **({"vae_tiling": tilings} if tilings else {}), "plan": plan.to_dict()}
