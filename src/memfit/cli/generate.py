"""``memfit generate`` and ``memfit encode``: the staged run of a model folder (memfit.run.generate)."""

from __future__ import annotations

import argparse
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["register"]


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="diffusers model folder (default: memfit's built-in demo model)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="run dtype (default fp32)")
    parser.add_argument("--device", help="torch device, e.g. cpu or cuda:0 (default: cuda if available)")


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``generate`` and ``encode`` subcommands."""
    gen = commands.add_parser("generate", help="generate an image (encode, denoise, decode as separate stages)")
    _add_model_args(gen)
    gen.add_argument("--prompt", help="what to draw")
    gen.add_argument("--negative-prompt", help="what to steer away from (needs --guidance > 1)")
    gen.add_argument("--embeddings", help="prompt embeddings from `memfit encode` (skips the text encoders)")
    gen.add_argument("--steps", type=int, help="denoising steps (default: the model's or pipeline's)")
    gen.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the model's or pipeline's)")
    gen.add_argument("--true-cfg", type=float, help="true classifier-free guidance scale, for pipelines that take "
                     "true_cfg_scale (Flux, QwenImage, Chroma); needs --negative-prompt")
    gen.add_argument("--frames", type=int, help="frames to generate, for video pipelines (num_frames: Wan)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--width", type=int)
    gen.add_argument("--height", type=int)
    gen.add_argument("--budget", default="auto", help="memory budget for each stage (the process, weights and activations): "
                     "auto (default: what this machine, container or GPU can spare now), none (no planning), or a size "
                     "such as 2GiB or 6GB (=6*10^9 bytes)")
    gen.add_argument("--timeline", help="write the run's memory timeline (weight movements, memory sampled over time): "
                     "PATH.json for the events, PATH.png for a plot")
    gen.add_argument("--backend", help="compile with a backend: NAME (eager, inductor, openvino, onnxruntime) or per "
                     "component, e.g. unet=openvino,vae=eager")
    gen.add_argument("--fallback", choices=("eager",), help="if a backend fails on a component, run it eagerly (reported)")
    gen.add_argument("--refiner", help="SDXL refiner folder: the base (--model) denoises up to --refiner-start, "
                     "the refiner finishes (diffusers' base + refiner workflow)")
    gen.add_argument("--refiner-start", type=float, help="fraction of the schedule the base runs before the refiner "
                     "takes over (default 0.8; needs --refiner)")
    gen.add_argument("--out", default="memfit.png", help="output PNG (default memfit.png)")
    gen.add_argument("--report", help="also write the per-stage report as JSON here")
    gen.add_argument("--quiet", action="store_true", help="no progress bar, no report table")
    gen.set_defaults(func=_generate)

    enc = commands.add_parser("encode", help="run only the text encoders and save the prompt embeddings")
    _add_model_args(enc)
    enc.add_argument("--prompt", required=True)
    enc.add_argument("--negative-prompt")
    enc.add_argument("--out", required=True, help="embeddings file to write (.safetensors)")
    enc.add_argument("--report", help="also write the stage report as JSON here")
    enc.add_argument("--budget", default="auto", help="memory budget for the stage, as for generate (default auto)")
    enc.add_argument("--quiet", action="store_true")
    enc.set_defaults(func=_encode)


def _check_out_path(path: str, suffix: str) -> Path:
    out = Path(path)
    if out.suffix.lower() != suffix:
        raise MemfitError(f"--out {path} should end in {suffix}.")
    if out.is_dir():
        raise MemfitError(f"--out {path} is a folder; give a file name ending in {suffix}.")
    return out


def _generate(args) -> int:
    from memfit.compile.entry_points import parse_backend_arg
    from memfit.run.generate import generate

    out = _check_out_path(args.out, ".png")
    if args.timeline and Path(args.timeline).suffix.lower() not in (".json", ".png"):
        raise MemfitError(f"--timeline {args.timeline} should end in .json (the events) or .png (a plot).")
    if args.prompt is None and args.embeddings is None:
        raise MemfitError("Nothing to draw: pass --prompt TEXT, or --embeddings FILE from memfit encode.")
    result = generate(
        args.prompt,
        model=args.model,
        embeddings=args.embeddings,
        negative_prompt=args.negative_prompt,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        width=args.width,
        height=args.height,
        dtype=args.dtype,
        device=args.device,
        budget=args.budget,
        backend=parse_backend_arg(args.backend) if args.backend else None,
        fallback=args.fallback,
        progress=not args.quiet,
        refiner=args.refiner,
        refiner_start=args.refiner_start,
        true_cfg_scale=args.true_cfg,
        num_frames=args.frames,
    )
    result.save(out)
    if args.report:
        result.report.write_json(args.report)
    if args.timeline:
        result.timeline.write(args.timeline)
    if not args.quiet:
        print(result.report.table())
    print(f"wrote {out}")
    return 0


def _encode(args) -> int:
    from memfit.run.generate import encode

    out = _check_out_path(args.out, ".safetensors")
    embeddings, report = encode(
        args.prompt, model=args.model, negative_prompt=args.negative_prompt, dtype=args.dtype, device=args.device,
        budget=args.budget,
    )
    embeddings.save(out)
    if args.report:
        report.write_json(args.report)
    if not args.quiet:
        print(report.table())
        shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in embeddings.tensors.items())
        print(f"embeddings: {shapes}")
    print(f"wrote {out}")
    return 0
