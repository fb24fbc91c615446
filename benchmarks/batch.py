"""memfit batch throughput: a 200-job batch in local mode against 200 separate `memfit generate`
calls, and on a local Ray cluster with 1 and 2 worker actors (1 CPU each).

Every configuration runs as the user would run it, a fresh command with a fresh prompt store, and
is timed from the command's start to its exit (imports, model load and planning included). The
model is memfit.testing's tiny Stable Diffusion pipeline (so the figures measure memfit's
per-job overhead more than the model); the jobs cycle through 10 prompts with distinct seeds.
The separate calls are measured on the first N_SEPARATE jobs and scaled to 200 (each call is
the same work). Writes docs/batch_throughput.json and .md.

    PYTHONPATH=src python benchmarks/batch.py [--jobs 200] [--separate 20] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write_outputs  # noqa: E402

PROMPTS = [f"a {colour} {shape} on a {back} background" for colour, shape, back in [
    ("red", "circle", "blue"), ("green", "square", "white"), ("blue", "triangle", "black"), ("white", "circle", "red"),
    ("black", "square", "green"), ("yellow", "triangle", "blue"), ("red", "square", "white"),
    ("green", "circle", "black"), ("blue", "square", "yellow"), ("white", "triangle", "green")]]


def _run(command: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--separate", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS); Ray "
                        "gives a 1-CPU actor one, so every row runs with the same number")
    args = parser.parse_args()
    load_at_start = os.getloadavg()

    from memfit.testing import save_pipeline

    work = Path(tempfile.mkdtemp(prefix="memfit-batch-bench-"))
    model = str(save_pipeline("sd", work / "model", seed=0))
    jobs = work / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"job-{i:04d}", "prompt": PROMPTS[i % len(PROMPTS)], "seed": i}) + "\n"
                            for i in range(args.jobs)))
    python = sys.executable
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    common = ["--model", model, "--steps", str(args.steps), "--width", str(args.size), "--height", str(args.size)]
    rows = []

    def env_for(name: str, **extra) -> dict:
        return dict(base_env, MEMFIT_CACHE_DIR=str(work / f"cache-{name}"), **extra)

    # 1. Separate memfit generate calls (one process per image), scaled to the batch size.
    env = env_for("separate")
    times = []
    for i in range(args.separate):
        seconds, _ = _run([python, "-m", "memfit", "generate", "--prompt", PROMPTS[i % len(PROMPTS)], "--seed", str(i),
                           *common, "--out", str(work / "separate" / f"job-{i:04d}.png"), "--quiet"], env)
        times.append(seconds)
        print(f"generate call {i + 1}/{args.separate}: {seconds:.2f} s", flush=True)
    per_call = sum(times) / len(times)
    rows.append({"mode": f"{args.jobs} separate `memfit generate` calls", "workers": 1,
                 "seconds": per_call * args.jobs, "images_per_minute": 60.0 / per_call,
                 "measured": f"{args.separate} calls, mean {per_call:.2f} s each, scaled"})

    # 2. memfit batch, local mode; 3. memfit batch --ray with 1 and 2 actors of 1 CPU each.
    configs = [("local", [], {}, 1), ("ray", ["--ray", "--workers", "1"], {}, 1), ("ray", ["--ray", "--workers", "2"], {}, 2)]
    for name, flags, extra, workers in configs:
        label = f"{name}-{workers}".replace(" ", "").replace(",", "")
        out = work / f"out-{label}"
        seconds, output = _run([python, "-m", "memfit", "batch", str(jobs), *common, "--out", str(out), "--quiet",
                                *flags], env_for(label, **extra))
        lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        assert len(lines) == args.jobs and all(line["status"] == "ok" for line in lines), output[-2000:]
        job_seconds = sorted(line["seconds"] for line in lines)
        rows.append({"mode": f"`memfit batch` {name}" + (f" ({workers} actor{'s' * (workers > 1)}, 1 CPU each)" if flags else ""),
                     "workers": workers, "seconds": seconds, "measured": f"{args.jobs} jobs, whole command",
                     "images_per_minute": 60.0 * args.jobs / seconds,
                     "median_job_seconds": job_seconds[len(job_seconds) // 2],
                     "first_job_seconds": max(job_seconds)})
        print(f"{rows[-1]['mode']}: {seconds:.1f} s, {rows[-1]['images_per_minute']:.1f} images/min", flush=True)

    separate = rows[0]["images_per_minute"]
    data = {"machine": machine(), "model": "memfit.testing tiny StableDiffusionPipeline (sd)", "jobs": args.jobs,
            "torch_threads_per_process": args.threads, "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
            "steps": args.steps, "size": args.size, "rows": rows}
    table = [f"# memfit batch throughput\n\n{args.jobs} jobs (10 prompts, distinct seeds), memfit.testing's tiny SD "
             f"pipeline, {args.steps} steps, {args.size}x{args.size}, fp32, {args.threads} torch thread(s) per process, "
             f"on {data['machine']['cpu_count']} shared CPU cores; each row is a fresh command timed start to exit (imports, load, plan included).\n",
             "| mode | wall s | images/min | vs separate calls | median s per job | measured |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        median = f"{row['median_job_seconds']:.2f}" if "median_job_seconds" in row else "-"
        table.append(f"| {row['mode']} | {row['seconds']:.1f} | {row['images_per_minute']:.1f} | "
                     f"{row['images_per_minute'] / separate:.1f}x | {median} | {row['measured']} |")
    write_outputs("batch_throughput", data, "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
