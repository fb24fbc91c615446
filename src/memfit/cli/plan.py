"""``memfit plan``: show where every weight would live under a budget, without loading any weights.

    memfit plan --arch sdxl --budget 4GiB
    memfit plan --model ./sdxl-base --budget 6GiB --host 16GiB --json
    memfit plan --model ./flux-dev          # budget auto: what this machine can spare now

With no --budget (or --budget auto) the budget is what this machine (its container, its GPU) can
spare now, as a run would detect it; the output's first line says where it came from. An explicit
budget is not checked against this machine: plan for any machine.

The architecture comes from a built-in config (archs.py) or from a diffusers folder's
model_index.json plus each component's config.json; meta.py sizes it, planner.py places it. Each
stage's activation strategy is chosen the way a run chooses it (memfit.plan.activations.choose): the
banded VAE decode as soon as the plain one would push a weight off the device, split guidance
passes only when the batched pass cannot be planned.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from memfit.cli.run_args import COMPONENT_HELP, CONFIG_HELP, check_budget, check_model_args, parse_components
from memfit.errors import MemfitError
from memfit.models.archs import ARCHS, get_arch
from memfit.plan.budget import Budget
from memfit.plan.planner import Plan, make_plan
from memfit.plan.stages import DEFAULT_STEPS, choose_strategies, planned_models, stage_options
from memfit.run.libraries import quiet_libraries
from memfit.sizes import format_bytes

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
    parser.add_argument("--budget", default="auto", help="device memory budget, e.g. 4GiB, 6GB (=6*10^9), 512MiB; "
                        "auto (default): what this machine can spare now; +SIZE (generate's budget on top of the "
                        "process) plans as SIZE")
    parser.add_argument("--host", help="host RAM for weights parked off the device (default: unlimited)")
    parser.add_argument("--disk", metavar="DIR", help="directory for memory-mapped weights (enables the disk tier)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="weight dtype (default fp32, as memfit generate)")
    parser.add_argument("--width", type=int, help="image width in pixels (default: the model's native size)")
    parser.add_argument("--height", type=int, help="image height in pixels (default: the model's native size)")
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
    width = args.width or adapter.default_size()
    height = args.height or adapter.default_size()
    if width <= 0 or height <= 0 or args.steps <= 0:
        raise MemfitError(f"--width, --height and --steps must be positive, got {width}, {height}, {args.steps}.")
    precision_line = None
    if args.precision is not None:
        from memfit.compile.precision import describe_precision

        precision_line = describe_precision(args.precision, args.dtype)
    budget, source = _budget(args)
    options = stage_options(adapter, dtype=args.dtype, width=width, height=height, steps=args.steps)
    stages, strategies = choose_strategies(options, budget, prefetch=args.prefetch)
    plan = make_plan(stages, budget, prefetch=args.prefetch)
    if args.json:
        extra = {"precision": precision_line} if precision_line else {}
        print(json.dumps({**_report(name, args.dtype, width, height, plan, strategies), "budget_source": source,
                          **extra}, indent=2))
    else:
        print(f"{name}: {description}; {width}x{height}, {args.dtype}, {args.steps} steps")
        print(f"budget: {source}")
        print(plan.table())
        for stage_options_, (stage, chosen) in zip(options, strategies.items()):
            if len(stage_options_) > 1:
                own = stage_options_[0][0]
                line = f"{stage}: {chosen}" + (" (the pipeline's own way)" if chosen == own.name else
                                                f" instead of {own.name}, which would need "
                                                f"{format_bytes(own.activation_bytes)} of activations")
                print(line)
        if precision_line:
            print(precision_line)
    return 0


def _budget(args: argparse.Namespace) -> tuple[Budget, str]:
    """The budget to plan with and where it came from. auto: as a run on this machine detects it (on a
    CPU-only machine host RAM is the device, so what does not fit streams from the model's files)."""
    from memfit.plan.budget import AUTO, above_process_size, resolve_budget

    if str(args.budget).strip().lower() != AUTO:
        # A plan leaves out the process's own memory, so "+SIZE" (on top of the process) plans as SIZE.
        budget = Budget(device=above_process_size(args.budget) or args.budget, host=args.host, disk=args.disk)
        return budget, f"explicit: device {format_bytes(budget.device)}"
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = resolve_budget(AUTO, device)
    detected = resolved.budget
    if device == "cpu":
        disk = args.disk or args.model or "(the model's safetensors files)"
        budget = Budget(device=detected.device, host=0, disk=disk)
    else:
        budget = Budget(device=detected.device, host=detected.host if args.host is None else args.host, disk=args.disk)
    return budget, resolved.source


def _source(args: argparse.Namespace):
    """(name, description, adapter) of the built-in architecture or the model folder asked for."""
    if args.arch:
        arch = get_arch(args.arch)
        return arch.name, arch.description, arch.adapter()
    from memfit.models.model_path import open_model_path

    if (args.config is not None or args.component) and args.model is None:
        raise MemfitError("--config and --component are for a model given as --model; --arch needs no files.")
    folder = open_model_path(args.model, config=args.config, components=parse_components(args.component))
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


def _report(name: str, dtype: str, width: int, height: int, plan: Plan, strategies: dict[str, str]) -> dict[str, Any]:
    return {"arch": name, "dtype": dtype, "width": width, "height": height, "strategies": strategies,
            "plan": plan.to_dict()}
