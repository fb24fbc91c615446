"""The threads a run computes with: memfit's default against --threads 1..N (N: the CPUs this
process may use), each run a fresh `memfit generate` process, rounds interleaved, medians.

    python benchmarks/threads.py --rounds 7

torch's own default (one thread per core) is not a column of its own: on a machine whose cores all
belong to the process it is --threads N. Uses the built-in demo model (SD 1.5 layout, 64x64, its
default steps), timing the denoise stage from each run's --report, and how far each image is from the
one thread draws. Writes docs/threads_demo.{json,md}; with --batch JOBS it times `memfit batch` of JOBS jobs
instead (docs/threads_demo_batch.{json,md}). The machine's load by other work during the runs is
recorded too (/proc/loadavg), since on a shared machine that is what decides the best count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent


def _run(threads: int | None, scratch: Path, steps: int | None) -> dict:
    report, out = scratch / "report.json", scratch / f"image-{threads or 'default'}.png"
    command = [sys.executable, "-m", "memfit", "generate", "--prompt", "a red circle on a blue background",
               "--quiet", "--out", str(out), "--report", str(report)]
    command += ["--threads", str(threads)] if threads else []
    command += ["--steps", str(steps)] if steps else []
    env = {**os.environ, "MEMFIT_CACHE": "0", "PYTHONPATH": str(ROOT / "src")}
    env.pop("OMP_NUM_THREADS", None)  # the default is memfit's own choice, not one inherited from here
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else None
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    data = json.loads(report.read_text())
    stages = {stage["stage"]: stage["seconds"] for stage in data["stages"]}
    return {"denoise": stages["denoise"], "stages": sum(stages.values()), "wall": wall, "threads": data["threads"],
            "load_before": load, "image": out}


def _run_batch(threads: int | None, scratch: Path, jobs: int, steps: int | None) -> dict:
    """One `memfit batch` of ``jobs`` jobs (the same prompt and seed) in a fresh process: its Session's runs after
    the first measure what others did during the one before."""
    import shutil

    jobs_file, out = scratch / "jobs.jsonl", scratch / "batch-out"
    shutil.rmtree(out, ignore_errors=True)
    line = {"prompt": "a red circle on a blue background", "seed": 0, **({"steps": steps} if steps else {})}
    jobs_file.write_text("".join(json.dumps({"id": f"job{i}", **line}) + "\n" for i in range(jobs)))
    command = [sys.executable, "-m", "memfit", "batch", str(jobs_file), "--out", str(out), "--quiet"]
    command += ["--threads", str(threads)] if threads else []
    env = {**os.environ, "MEMFIT_CACHE": "0", "PYTHONPATH": str(ROOT / "src")}
    env.pop("OMP_NUM_THREADS", None)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else None
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    results = [json.loads(raw) for raw in (out / "results.jsonl").read_text().splitlines()]
    return {"jobs": sum(r["seconds"] for r in results), "wall": wall, "load_before": load,
            "threads": [r.get("threads") for r in results], "image": out / "job0.png"}


def _interleaved(args, measure, describe) -> tuple[int, str, dict[str, list[dict]], list[int]]:
    """memfit's default thread count and --threads 1..N, each measured by ``measure(threads, scratch)`` (None: the
    default) in args.rounds rounds that alternate their order, after a one-thread warm-up run whose image every
    result's is compared with: (usable CPUs, why, results by label, the largest per-pixel differences)."""
    from common import max_difference

    from memfit.run.threads import usable_cpus

    cores, why = usable_cpus()
    configs = [None, *range(1, cores + 1)]
    label = {None: "default", **{n: f"--threads {n}" for n in range(1, cores + 1)}}
    runs: dict[str, list[dict]] = {label[c]: [] for c in configs}
    differences = []
    with tempfile.TemporaryDirectory() as scratch:
        reference = Path(scratch) / "reference.png"
        _run(1, Path(scratch), args.steps)["image"].rename(reference)  # warm-up: the page cache holds the model
        for round_ in range(args.rounds):
            for config in configs if round_ % 2 == 0 else configs[::-1]:
                result = measure(config, Path(scratch))
                differences.append(max_difference(result.pop("image"), reference))
                runs[label[config]].append(result)
                print(f"round {round_ + 1} {label[config]}: {describe(result)}, load {result['load_before']}", flush=True)
    return cores, why, runs, differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, help="denoising steps (default: the demo model's)")
    parser.add_argument("--name", default="threads_demo", help="docs/NAME.{json,md}")
    parser.add_argument("--batch", type=int, metavar="JOBS", help="time `memfit batch` of JOBS jobs instead "
                        "(docs/NAME_batch.{json,md})")
    args = parser.parse_args()
    if args.batch:
        return batch_main(args)
    from common import machine, write_outputs

    def describe(result: dict) -> str:
        chosen = result["threads"]
        return f"denoise {result['denoise']:.2f} s, threads {chosen['count']} ({chosen['source']})"

    cores, why, runs, differences = _interleaved(args, lambda config, scratch: _run(config, scratch, args.steps),
                                                 describe)
    median = {name: statistics.median(r["denoise"] for r in values) for name, values in runs.items()}
    median_stages = {name: statistics.median(r["stages"] for r in values) for name, values in runs.items()}
    best = min((name for name in runs if name != "default"), key=median.get)
    ratio = median["default"] / median[best]
    chosen_counts = [r["threads"]["count"] for r in runs["default"]]
    seconds = {name: ", ".join(f"{r['denoise']:.2f}" for r in values) for name, values in runs.items()}
    rows = [f"| {name} | {median[name]:.2f} | {median_stages[name]:.2f} | {seconds[name]} |" for name in runs]
    table = "\n".join([
        "# Threads: memfit's default against --threads 1..N",
        "",
        f"`memfit generate` on the built-in demo model (64x64, fp32, CPU), a fresh process per run, {args.rounds} "
        f"interleaved rounds; {cores} usable CPUs ({why}); torch {machine()['torch']}. Seconds of the denoise stage "
        "(from each run's --report), and of all stages.",
        "",
        "| threads | median denoise s | median all stages s | denoise runs (s) |",
        "|---|---|---|---|",
        *rows,
        "",
        f"default / best ({best}) = {ratio:.3f} (denoise medians); the default chose "
        f"{', '.join(map(str, chosen_counts))} thread(s) in its runs; the images differ from the one thread's by at most "
        f"{max(differences)}/255. Load average before the runs: "
        f"{', '.join(str(r['load_before']) for values in runs.values() for r in values[:1])} (first run of each).",
        "",
    ])
    write_outputs(args.name, {"machine": machine(), "args": vars(args), "usable_cpus": cores, "why": why,
                              "runs": runs, "median_denoise": median, "median_stages": median_stages, "best": best,
                              "default_over_best": ratio, "max_difference": max(differences)}, table)
    print(table)


def batch_main(args) -> None:
    from common import machine, write_outputs

    cores, why, runs, differences = _interleaved(
        args, lambda config, scratch: _run_batch(config, scratch, args.batch, args.steps),
        lambda result: f"batch {result['wall']:.1f} s, jobs {result['jobs']:.1f} s, threads {result['threads']}")
    median = {name: statistics.median(r["wall"] for r in values) for name, values in runs.items()}
    median_jobs = {name: statistics.median(r["jobs"] for r in values) for name, values in runs.items()}
    best = min((name for name in runs if name != "default"), key=median.get)
    ratio = median["default"] / median[best]
    seconds = {name: ", ".join(f"{r['wall']:.1f}" for r in values) for name, values in runs.items()}
    table = "\n".join([
        "# Threads in a batch: memfit's default against --threads 1..N",
        "",
        f"`memfit batch` of {args.batch} jobs (the same prompt and seed) on the built-in demo model (64x64, fp32, "
        f"CPU), a fresh process per batch, {args.rounds} interleaved rounds; {cores} usable CPUs ({why}); torch "
        f"{machine()['torch']}. Seconds from start to exit, and the jobs' own seconds (results.jsonl).",
        "",
        "| threads | median batch s | median jobs s | batch runs (s) |",
        "|---|---|---|---|",
        *[f"| {name} | {median[name]:.1f} | {median_jobs[name]:.1f} | {seconds[name]} |" for name in runs],
        "",
        f"default / best ({best}) = {ratio:.3f} (batch medians); the first job's image differs from a one-shot "
        f"one-thread run's by at most {max(differences)}/255. Load average before the first run of each: "
        f"{', '.join(str(values[0]['load_before']) for values in runs.values())}.",
        "",
    ])
    write_outputs(f"{args.name}_batch", {"machine": machine(), "args": vars(args), "usable_cpus": cores, "why": why,
                                        "runs": runs, "median_batch": median, "median_jobs": median_jobs,
                                        "best": best, "default_over_best": ratio,
                                        "max_difference": max(differences)}, table)
    print(table)


if __name__ == "__main__":
    main()
