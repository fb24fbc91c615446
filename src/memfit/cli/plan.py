"""``memfit plan``: show where every weight would live under a budget, without loading any weights.

    memfit plan --arch sdxl --budget 4GiB
    memfit plan --model ./sdxl-base --budget 6GiB --host 16GiB --json

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
from pathlib import Path
from typing import Any

from memfit.models.archs import ARCHS, Arch, ComponentSpec, get_arch, standard_stages
from memfit.plan.budget import Budget, format_size
from memfit.errors import MemfitError
from memfit.plan.planner import Plan, StageInput, make_plan, stage_input

__all__ = ["build_stages", "choose_strategies", "load_model_dir", "register", "run_plan", "stage_options"]

DEFAULT_STEPS = 30

# Pipelines whose denoiser sees batch 1 per image (guidance distilled into the model); every
# other pipeline is assumed to batch cond + uncond (batch 2), the safe side for memory.
_UNGUIDED_PIPELINES = {"FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"}
_DENOISER_NAMES = ("unet", "transformer", "prior")
_ACTIVATION_KIND = {"text_encoder": "text_encoder", "vae": "vae_decoder"}


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
    source.add_argument("--model", metavar="DIR", help="a diffusers pipeline folder (reads only JSON configs)")
    parser.add_argument("--budget", required=True, help='device memory budget, e.g. 4GiB, 6GB (=6*10^9), 512MiB')
    parser.add_argument("--host", help="host RAM for weights parked off the device (default: unlimited)")
    parser.add_argument("--disk", metavar="DIR", help="directory for memory-mapped weights (enables the disk tier)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="weight dtype (default bf16)")
    parser.add_argument("--width", type=int, help="image width in pixels (default: the model's native size)")
    parser.add_argument("--height", type=int, help="image height in pixels (default: the model's native size)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="denoising steps (decides host vs disk)")
    parser.add_argument("--prefetch", type=int, default=1, help="blocks copied ahead while one runs (default 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan for ``args`` (see ``register``); return the exit code. Raises MemfitError."""
    arch = get_arch(args.arch) if args.arch else load_model_dir(args.model)
    width = args.width or arch.default_size
    height = args.height or arch.default_size
    if width <= 0 or height <= 0 or args.steps <= 0:
        raise MemfitError(f"--width, --height and --steps must be positive, got {width}, {height}, {args.steps}.")
    budget = Budget(device=args.budget, host=args.host, disk=args.disk)
    options = stage_options(arch, dtype=args.dtype, width=width, height=height, steps=args.steps)
    stages, strategies = choose_strategies(options, budget, prefetch=args.prefetch)
    plan = make_plan(stages, budget, prefetch=args.prefetch)
    if args.json:
        print(json.dumps(_report(arch, args.dtype, width, height, plan, strategies), indent=2))
    else:
        print(f"{arch.name}: {arch.description}; {width}x{height}, {args.dtype}, {args.steps} steps")
        print(plan.table())
        for stage_options_, (stage, chosen) in zip(options, strategies.items()):
            if len(stage_options_) > 1:
                own = stage_options_[0][0]
                line = f"{stage}: {chosen}" + (" (the pipeline's own way)" if chosen == own.name else
                                                f" instead of {own.name}, which would need "
                                                f"{format_size(own.activation_bytes)} of activations")
                print(line)
    return 0


def _report(arch: Arch, dtype: str, width: int, height: int, plan: Plan, strategies: dict[str, str]) -> dict[str, Any]:
    return {"arch": arch.name, "dtype": dtype, "width": width, "height": height, "strategies": strategies,
            "plan": plan.to_dict()}


def build_stages(arch: Arch, *, dtype: str, width: int, height: int, steps: int = DEFAULT_STEPS) -> list[StageInput]:
    """Measure ``arch``'s components on the meta device and turn its stage layout into StageInputs,
    each with the activations of the pipeline's own way of running it."""
    return [options[0][1] for options in stage_options(arch, dtype=dtype, width=width, height=height, steps=steps)]


def choose_strategies(options, budget: Budget, *, prefetch: int = 1) -> tuple[list[StageInput], dict[str, str]]:
    """Per stage, the strategy a run would choose under ``budget`` (memfit.plan.activations.choose)."""
    from memfit.plan.activations import choose

    stages, names = [], {}
    for stage_options_ in options:
        by_bytes = {strategy.activation_bytes: stage for strategy, stage in stage_options_}
        strategy, _ = choose([strategy for strategy, _ in stage_options_],
                             lambda activations: make_plan([by_bytes[activations]], budget, prefetch=prefetch))
        stages.append(by_bytes[strategy.activation_bytes])
        names[stages[-1].name] = strategy.name
    return stages, names


def stage_options(arch: Arch, *, dtype: str, width: int, height: int,
                  steps: int = DEFAULT_STEPS) -> list[list[tuple[Any, StageInput]]]:
    """Per stage, its (Strategy, StageInput) options in memfit.plan.activations' order, the pipeline's own first."""
    from memfit.plan.activations import Strategy
    from memfit.run.banded_decode import unsupported_reason_for_config
    from memfit.plan.meta import activation_estimate, measure_component  # imports torch: only when planning

    vae = _find_role(arch, "vae")
    vae_scale = 2 ** (len(vae.config.get("block_out_channels", (0, 0, 0, 0))) - 1) if vae else 8
    guidance_batch = arch.denoise_batch
    result = []
    for spec in arch.stages:
        components, activations, lean = [], 0, None
        for component_name, submodules in spec.uses:
            component = arch.component(component_name)
            component_dtype = _execution_dtype(component, dtype)
            size = measure_component(
                component.name, component.library, component.class_name, component.config, component_dtype
            ).select(submodules)
            components.append(size)
            kind = "unet" if component.class_name.startswith("UNet") else "transformer"
            kind = _ACTIVATION_KIND.get(component.role, kind)
            batch = 1 if component.role == "vae" else guidance_batch
            # Components of one stage run one after another, so the stage peak is the largest.
            estimate = dict(width=width, height=height, dtype=component_dtype, vae_scale=vae_scale,
                            text_tokens=arch.text_tokens, class_name=component.class_name)
            activations = max(activations, activation_estimate(kind, component.config, batch=batch, **estimate))
            if component.role == "vae" and unsupported_reason_for_config(component.config) is None:
                lean = Strategy("banded", activation_estimate("vae_decoder_banded", component.config, **estimate))
            elif kind == "unet" and batch == 2:
                # memfit's SD and SDXL adapters run the two guidance passes apart when needed
                # (pipelines/stable_diffusion.py: splits_guidance); UNet pipelines are those.
                lean = Strategy("split", activation_estimate(kind, component.config, batch=1, **estimate), cheap=False)
        runs = steps if spec.name == "denoise" else 1
        own = Strategy({"encode": "plain", "denoise": "batched", "decode": "plain"}.get(spec.name, "plain"), activations)
        result.append([(strategy, stage_input(spec.name, components, strategy.activation_bytes, runs=runs))
                       for strategy in (own, lean) if strategy is not None])
    return result


def _execution_dtype(component: ComponentSpec, dtype: str) -> str:
    # diffusers runs a VAE whose config says force_upcast in fp32 when the pipeline is fp16
    # (fp16 overflows in its decoder), so its weights and activations are fp32-sized then.
    if component.role == "vae" and dtype == "fp16" and component.config.get("force_upcast", True):
        return "fp32"
    return dtype


def _find_role(arch: Arch, role: str) -> ComponentSpec | None:
    return next((c for c in arch.components if c.role == role), None)


# --- diffusers folders ------------------------------------------------------------------------


def load_model_dir(path: str | Path) -> Arch:
    """Read a diffusers pipeline folder's model_index.json and each model's config.json into an Arch.

    Only JSON is read. Text encoders (names starting with "text_encoder"), the denoiser ("unet",
    "transformer", "prior") and the "vae" are planned; other models (safety checker, image
    encoder) are left out of the plan and named in the description.
    """
    root = Path(path)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise MemfitError(
            f"{index_file} does not exist; --model expects a diffusers pipeline folder "
            "(the one holding model_index.json), or use --arch for a built-in architecture."
        )
    index = _read_json(index_file)
    from memfit.plan.meta import is_model_class  # imports diffusers/transformers

    components, skipped = [], []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        library, class_name = entry
        if not is_model_class(library, class_name):
            continue  # tokenizers, schedulers, feature extractors: nothing to place
        role = _role_of(name)
        if role is None:
            skipped.append(f"{name} ({class_name})")
            continue
        config_file = root / name / "config.json"
        if not config_file.is_file():
            raise MemfitError(
                f"{config_file} does not exist but model_index.json lists {name!r} as {library}.{class_name}; "
                "copy the component's config.json there (weights are not needed)."
            )
        components.append(ComponentSpec(name, library, class_name, _read_json(config_file), role))

    denoisers = [c.name for c in components if c.role == "denoiser"]
    text_encoders = tuple(c.name for c in components if c.role == "text_encoder")
    if not denoisers or not any(c.role == "vae" for c in components):
        raise MemfitError(
            f"{index_file} names no denoiser ({'/'.join(_DENOISER_NAMES)}) or no 'vae' among the models "
            f"memfit can size ({[c.name for c in components]}); memfit plans text-to-image pipelines."
        )
    stages = standard_stages(text_encoders, denoisers[0])
    if len(denoisers) > 1:  # e.g. two experts: both run in the denoise stage
        stages = (stages[0], dataclasses.replace(stages[1], uses=tuple((d, None) for d in denoisers)), stages[2])
    denoiser = next(c for c in components if c.role == "denoiser")
    vae = next(c for c in components if c.role == "vae")
    vae_scale = 2 ** (len(vae.config.get("block_out_channels", (0, 0, 0, 0))) - 1)
    pipeline = str(index.get("_class_name", "pipeline"))
    description = f"{pipeline} from {root}"
    if skipped:
        description += f" (not planned: {', '.join(skipped)})"
    return Arch(
        name=root.name or str(root),
        description=description,
        components=tuple(components),
        stages=stages,
        denoise_batch=1 if pipeline in _UNGUIDED_PIPELINES else 2,
        # sample_size is the latent side the denoiser was trained at (128 for SDXL and Flux).
        default_size=int(denoiser.config.get("sample_size", 128)) * vae_scale,
        text_tokens=_text_tokens(components),
    )


def _role_of(name: str) -> str | None:
    if name.startswith("text_encoder"):
        return "text_encoder"
    if name in _DENOISER_NAMES:
        return "denoiser"
    if name == "vae":
        return "vae"
    return None


def _text_tokens(components) -> int:
    # Prompts longer than this are rare; a long-context encoder (Gemma: 8192) is capped at 512.
    lengths = [min(int(c.config.get("max_position_embeddings") or 512), 512) for c in components if c.role == "text_encoder"]
    return max(lengths, default=77)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise MemfitError(f"Cannot read {path}: {exc.strerror}.") from None
    except json.JSONDecodeError as exc:
        raise MemfitError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}); fix or re-download it.") from None
    if not isinstance(data, dict):
        raise MemfitError(f"{path} should hold a JSON object, found {type(data).__name__}.")
    return data
