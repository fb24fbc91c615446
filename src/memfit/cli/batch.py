"""``memfit batch``: run every job of a JSONL file (memfit.batch), resumable, locally or on Ray."""

from __future__ import annotations

import argparse

from memfit.cli.run_args import add_run_args, check_budget, check_model_args, run_options
from memfit.errors import MemfitError
from memfit.models.limits import check_settings
from memfit.run.libraries import quiet_libraries

__all__ = ["register"]


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``batch`` subcommand."""
    cmd = commands.add_parser(
        "batch", help="generate many images from a JSONL file of jobs (resumable; optionally on Ray)",
        description='Each line of JOBS is one job: {"id": ..., "prompt": ..., "negative_prompt": ..., "seed": ..., '
                    '"steps": ..., "guidance": ..., "width": ..., "height": ..., "loras": ["style.safetensors:0.8"]}; '
                    'missing fields take the flags below. '
                    "Writes OUT/<id>.png and OUT/results.jsonl; running it again skips finished jobs.")
    cmd.add_argument("jobs", metavar="JOBS.jsonl", help="one JSON job per line")
    add_run_args(cmd, budget_note="each worker's, auto detected on the worker's own machine")
    cmd.add_argument("--out", required=True, help="folder for <id>.png and results.jsonl")
    cmd.add_argument("--negative-prompt", help="default negative prompt of the jobs")
    cmd.add_argument("--steps", type=int, help="default denoising steps (default: the model's or pipeline's)")
    cmd.add_argument("--guidance", type=float, help="default guidance scale (default: the model's or pipeline's)")
    cmd.add_argument("--seed", type=int, default=0, help="default seed (default 0)")
    cmd.add_argument("--width", type=int)
    cmd.add_argument("--height", type=int)
    cmd.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                     help="default LoRA of the jobs (a job's \"loras\" replaces them); repeat for several")
    cmd.add_argument("--strict", action="store_true", help="refuse the whole batch if any line is bad "
                     "(default: report bad lines with their numbers and skip them)")
    cmd.add_argument("--retry-failed", action="store_true", help="run again the jobs an earlier run recorded as failed")
    cmd.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                     help="run on Ray: alone, start a local Ray cluster; with ADDRESS, join one started with "
                          "`ray start --head` (needs pip install 'memfit[ray]'); --device and --budget are each "
                          "worker's")
    cmd.add_argument("--workers", type=int, help="Ray workers (default: one per GPU of the cluster, else 1)")
    cmd.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each Ray worker reserves (default 1)")
    cmd.add_argument("--quiet", action="store_true", help="no progress bar")
    cmd.set_defaults(func=_batch)


def _batch(args) -> int:
    if args.workers is not None and args.workers < 1:
        raise MemfitError(f"--workers {args.workers}: give at least 1.")
    if args.cpus_per_worker <= 0:
        raise MemfitError(f"--cpus-per-worker {args.cpus_per_worker}: give a positive number of CPUs.")
    check_settings(steps=args.steps, guidance=args.guidance, seed=args.seed)  # the defaults of every job
    check_budget(args.budget)
    check_model_args(args)
    quiet_libraries()
    from memfit.batch import BatchOptions, JobDefaults, run_batch
    from memfit.models.lora import check_loras

    options = BatchOptions(
        **run_options(args), out=args.out,
        defaults=JobDefaults(negative_prompt=args.negative_prompt, seed=args.seed, steps=args.steps,
                             guidance=args.guidance, width=args.width, height=args.height,
                             loras=check_loras(args.lora)),
        strict=args.strict, retry_failed=args.retry_failed, progress=not args.quiet,
    )
    summary = run_batch(args.jobs, options, ray=args.ray, workers=args.workers, cpus_per_worker=args.cpus_per_worker)
    print(f"memfit batch: {summary.line()}; results in {options.out}/results.jsonl")
    return 1 if summary.failed else 0
