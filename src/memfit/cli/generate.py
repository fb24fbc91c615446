"""``memfit generate`` and ``memfit encode``: the staged run of a model folder (memfit.run.generate)."""

from __future__ import annotations

import argparse
from pathlib import Path

from memfit.atomic import check_writable
from memfit.cli.run_args import (THREADS_HELP, add_model_args, add_run_args, check_budget, check_model_args,
                                 parse_components, parse_quantize, run_options)
from memfit.errors import MemfitError
from memfit.models.limits import check_settings
from memfit.run.libraries import quiet_libraries

__all__ = ["register"]


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``generate`` and ``encode`` subcommands."""
    gen = commands.add_parser("generate", help="generate an image (encode, denoise, decode as separate stages)")
    add_run_args(gen)
    gen.add_argument("--prompt", help="what to draw")
    gen.add_argument("--negative-prompt", help="what to steer away from (needs --guidance > 1)")
    gen.add_argument("--embeddings", help="prompt embeddings from `memfit encode` (skips the text encoders)")
    gen.add_argument("--steps", type=int, help="denoising steps (default: the model's or pipeline's)")
    gen.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the model's or pipeline's)")
    gen.add_argument("--true-cfg", type=float, help="true classifier-free guidance scale, for pipelines that take "
                     "true_cfg_scale (Flux, QwenImage, Chroma); needs --negative-prompt")
    gen.add_argument("--frames", type=int, help="frames to generate, for video pipelines (num_frames: Wan)")
    gen.add_argument("--guidance-2", type=float, help="guidance of Wan 2.2's low-noise expert, transformer_2 "
                     "(guidance_scale_2; default: --guidance)")
    gen.add_argument("--sampler", help="sample with this AUTOMATIC1111 sampler instead of the model's scheduler, "
                     "e.g. \"Euler a\", \"DPM++ 2M Karras\", DDIM (recorded in the PNG)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--width", type=int)
    gen.add_argument("--height", type=int)
    gen.add_argument("--timeline", help="write the run's memory timeline (weight movements, memory sampled over time): "
                     "PATH.json for the events, PATH.png for a plot")
    gen.add_argument("--precision", metavar="{fp32,bf16,fp16}",
                     help="compute precision of the backend (default: --dtype): OpenVINO computes in it whatever the "
                     "weights' --dtype (e.g. fp32 weights, bf16 kernels); eager PyTorch and the other backends compute "
                     "in --dtype, so for them it must equal --dtype")
    gen.add_argument("--refiner", help="SDXL refiner folder or checkpoint file: the base (--model) denoises up to "
                     "--refiner-start, the refiner finishes (diffusers' base + refiner workflow)")
    gen.add_argument("--refiner-config", metavar="DIR", help="for a refiner checkpoint file: a diffusers SDXL refiner "
                     "folder to read its configs and tokenizer from (default: found as --config's are)")
    gen.add_argument("--refiner-start", type=float, help="fraction of the schedule the base runs before the refiner "
                     "takes over (default 0.8; needs --refiner)")
    gen.add_argument("--image", action="append", help="init image: img2img (with --strength), the image to inpaint "
                     "(with --mask; FLUX.1 Fill needs both), the image to edit or refer to (FLUX.1 Kontext, FLUX.2, "
                     "Qwen-Image-Edit), or a video's first frame (Wan image to video); repeat it for a pipeline that "
                     "takes several (Qwen-Image-Edit-Plus)")
    gen.add_argument("--strength", type=float, help="how far --image is noised before denoising, in (0, 1] "
                     "(default: the pipeline's, 0.8 for img2img)")
    gen.add_argument("--mask", help="inpainting mask for --image: white is repainted, black kept")
    gen.add_argument("--control-image", help="the image a ControlNet follows (needs --controlnet DIR, or a "
                     "ControlNet pipeline folder as --model)")
    gen.add_argument("--controlnet", help="a diffusers ControlNet model folder; planned in the denoise stage")
    gen.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                     help="a LoRA .safetensors file, with its scale (default 1); repeat for several")
    gen.add_argument("--out", help="output file: .png for an image; .mp4, .webp or .gif for a video (.png writes its "
                     "first frame; .mp4 needs memfit[video]) (default memfit.png, or memfit.mp4 for a video)")
    gen.add_argument("--fps", type=int, help="frames per second of a video file (default: the model's, 16 for Wan)")
    gen.add_argument("--report", help="also write the per-stage report as JSON here")
    gen.add_argument("--quiet", action="store_true", help="no progress bar, no report table")
    gen.set_defaults(func=_generate)

    enc = commands.add_parser("encode", help="run only the text encoders and save the prompt embeddings")
    add_model_args(enc)
    enc.add_argument("--prompt", required=True)
    enc.add_argument("--negative-prompt")
    enc.add_argument("--image", action="append", help="the image to edit, for a family whose text encoder sees it "
                     "with the prompt (Qwen-Image-Edit; repeat it for Qwen-Image-Edit-Plus's several); generate from "
                     "the embeddings with the same --image")
    enc.add_argument("--out", required=True, help="embeddings file to write (.safetensors)")
    enc.add_argument("--report", help="also write the stage report as JSON here")
    enc.add_argument("--budget", default="auto", help="memory budget for the stage, as for generate (default auto)")
    enc.add_argument("--threads", metavar="N", help=THREADS_HELP)
    enc.add_argument("--quiet", action="store_true")
    enc.set_defaults(func=_encode)


def _check_out_path(path: str, suffix: str) -> Path:
    """``--out``, checked before anything loads: a failed check costs nothing (memfit.atomic.check_writable)."""

    out = Path(path)
    if out.suffix.lower() != suffix:
        raise MemfitError(f"--out {path} should end in {suffix}.")
    if out.is_dir():
        raise MemfitError(f"--out {path} is a folder; give a file name ending in {suffix}.")
    return check_writable(out)


def _output_path(args, model) -> Path:
    """Where the result goes, checked before any work so a long run is never lost to a bad name."""
    from memfit.run.media import IMAGE_SUFFIXES, VIDEO_SUFFIXES, check_video_writer
    from memfit.run.stages import check_frame_rate

    video = model.adapter.makes_video
    check_frame_rate(model.adapter, args.fps)
    if args.out is None:
        if not video:
            return Path("memfit.png")
        try:
            import av  # noqa: F401
            return Path("memfit.mp4")
        except ImportError:
            return Path("memfit.webp")  # Pillow writes it; MP4 needs the optional PyAV
    out = Path(args.out)
    suffixes = IMAGE_SUFFIXES + VIDEO_SUFFIXES if video else IMAGE_SUFFIXES
    if out.suffix.lower() not in suffixes:
        what = "a video" if video else "an image"
        raise MemfitError(f"--out {args.out}: this model makes {what}; give a file name ending in {', '.join(suffixes)}.")
    if out.is_dir():
        raise MemfitError(f"--out {args.out} is a folder; give a file name ending in {', '.join(suffixes)}.")
    if out.suffix.lower() in VIDEO_SUFFIXES:
        check_video_writer(out)
    return check_writable(out)


def _refuse_before_loading(args) -> None:
    """Refuse what needs no model at once: before torch and diffusers are imported, which takes seconds."""
    if args.timeline and Path(args.timeline).suffix.lower() not in (".json", ".png"):
        raise MemfitError(f"--timeline {args.timeline} should end in .json (the events) or .png (a plot).")
    if args.prompt is None and args.embeddings is None:
        raise MemfitError("Nothing to draw: pass --prompt TEXT, or --embeddings FILE from memfit encode.")
    if args.fps is not None and args.fps < 1:
        raise MemfitError(f"--fps must be at least 1, got {args.fps}.")
    check_settings(steps=args.steps, guidance=args.guidance, seed=args.seed)
    check_budget(args.budget)
    check_model_args(args)


def _generate(args) -> int:
    _refuse_before_loading(args)
    quiet_libraries()  # before the imports below: transformers warns as its image processors are imported
    from memfit.run.generate import generate
    from memfit.run.stages import open_model

    # Opened once: a checkpoint file's configs are found (and a pickle read) here, not again in generate.
    model = open_model(args.model, allow_pickle=args.allow_pickle, config=args.config,
                       components=parse_components(args.component), quantize=parse_quantize(args.quantize))
    out = _output_path(args, model)
    if args.report:
        check_writable(args.report, "--report")
    result = generate(
        args.prompt,
        **dict(run_options(args), model=model, config=None, components=None, quantize=None),
        embeddings=args.embeddings,
        negative_prompt=args.negative_prompt,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        width=args.width,
        height=args.height,
        progress=not args.quiet,
        refiner=args.refiner,
        refiner_start=args.refiner_start,
        refiner_config=args.refiner_config,
        true_cfg_scale=args.true_cfg,
        frames=args.frames,
        guidance_scale_2=args.guidance_2,
        image=args.image,
        strength=args.strength,
        mask=args.mask,
        control_image=args.control_image,
        controlnet=args.controlnet,
        loras=args.lora,
        sampler=args.sampler,
        precision=args.precision,
    )
    result.save(out, frames_per_second=args.fps)
    if args.report:
        result.report.write_json(args.report)
    if args.timeline:
        result.timeline.write(args.timeline)
    if not args.quiet:
        print(result.report.table())
    print(f"wrote {out}")
    if result.audio is not None and Path(out).suffix.lower() in (".webp", ".gif"):  # they hold no audio
        print(f"wrote {Path(out).with_suffix('.wav')} (the soundtrack)")
    return 0


def _encode(args) -> int:
    out = _check_out_path(args.out, ".safetensors")
    check_budget(args.budget)
    check_model_args(args)
    quiet_libraries()
    from memfit.run.generate import encode
    from memfit.run.threads import check_threads

    threads = check_threads(args.threads)
    if args.report:
        check_writable(args.report, "--report")
    embeddings, report = encode(
        args.prompt, model=args.model, negative_prompt=args.negative_prompt, dtype=args.dtype, device=args.device,
        budget=args.budget, allow_pickle=args.allow_pickle, config=args.config,
        components=parse_components(args.component), quantize=parse_quantize(args.quantize), threads=threads,
        image=args.image,
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
