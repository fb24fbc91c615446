"""Compiled backends inside a budget (issue 18): `--backend openvino --budget 2GiB` on SD 1.5 under a 2 GiB
cgroup cap, side by side with the same run uncapped and with the alternatives a user has under that cap.

    python benchmarks/openvino_budget.py                 # bf16, 512x512, 4 steps, 3 rounds -> docs/openvino_budget.{json,md}
    python benchmarks/openvino_budget.py --tiny --cap-gib 0 --rounds 1   # tiny pipeline, uncapped: smoke-test the script

Rows, each a fresh process (`memfit generate`, or plain diffusers), interleaved over --rounds rounds:

  memfit openvino, no budget, uncapped     the whole UNet, text encoder and VAE as OpenVINO models (the reference image)
  memfit openvino, budget, capped, cold    --budget = the cap, under the cap, on an empty memfit store: the UNet's
                                           compiled model does not fit whole, so the blocks the plan keeps resident
                                           are compiled (built here), the rest stream eagerly from the files
  memfit openvino, budget, capped, warm    the same on a store that holds what the cold run built
  memfit eager, budget, capped             no backend: memfit's eager streaming under the same budget and cap
  diffusers eager, capped                  plain diffusers (from_pretrained + __call__) under the same cap

Before each run the page cache of the model's files and of the store is dropped, so that a capped run is
charged for every byte it reads (a cgroup cap counts page cache). Warm rows find their prompt's
embeddings in the store (encode skipped), as a user's second start does; plain diffusers encodes every time.
Per row: completed or killed, seconds from launch to the written image, the cgroup's peak (RSS + page cache),
and the image's largest difference from the uncapped reference of the same round (0..255).

The model (real size, random weights; rebuilt when absent) lives outside the repository under --models.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30
PROMPT = "a lighthouse at dusk"
REFERENCE = "memfit openvino, no budget, uncapped"
COLD = "memfit openvino, budget, capped, cold"
WARM = "memfit openvino, budget, capped, warm"
EAGER = "memfit eager, budget, capped"
DIFFUSERS = "diffusers eager, capped"
ROWS = (REFERENCE, COLD, WARM, EAGER, DIFFUSERS)

DIFFUSERS_CHILD = """
import sys, torch, diffusers
model, dtype, size, steps, out = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
pipe = diffusers.StableDiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
pipe.set_progress_bar_config(disable=True)
pipe(sys.argv[6], num_inference_steps=steps, width=size, height=size, generator=torch.Generator().manual_seed(1)).images[0].save(out)
"""


def command_for(row: str, model: Path, image: Path, args) -> list[str]:
    if row == DIFFUSERS:
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
        return [sys.executable, "-c", DIFFUSERS_CHILD, str(model), dtype, str(args.size), str(args.steps), str(image),
                PROMPT]
    memfit = str(Path(sys.executable).with_name("memfit"))
    command = [memfit, "generate", "--model", str(model), "--prompt", PROMPT, "--steps", str(args.steps), "--seed", "1",
               "--width", str(args.size), "--height", str(args.size), "--dtype", args.dtype, "--out", str(image),
               "--budget", "none" if row == REFERENCE else f"{args.cap_gib}GiB" if args.cap_gib else "auto"]
    if row != EAGER:
        command += ["--backend", "openvino"]
    return command


def measure(row: str, model: Path, store: Path, image: Path, args) -> dict:
    from memfit.testing.cgroup import evict_page_cache, run_capped

    capped = row != REFERENCE and args.cap_gib
    image.unlink(missing_ok=True)
    for folder in (model, store):
        evict_page_cache(folder)
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(store), "HF_HUB_OFFLINE": "1"}
    run = run_capped(command_for(row, model, image, args), int(args.cap_gib * GiB) if capped else None,
                     timeout=args.timeout, env=env)
    result = {"completed": run.completed and image.is_file(), "killed": run.killed, "seconds": run.seconds,
              "cgroup_peak_bytes": run.max_usage_bytes}
    if not result["completed"] and not run.killed:
        result["error"] = (run.stderr.strip().splitlines() or ["(no output)"])[-1][-300:]
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: denoise")]
    if notes:
        result["denoise_notes"] = notes
    return result


def render(data: dict) -> str:
    a = data["args"]
    cap = f"{a['cap_gib']:g} GiB" if a["cap_gib"] else "none (smoke test)"
    lines = [
        f"# Compiled backends inside a budget: SD 1.5 ({'tiny' if a['tiny'] else 'real size'}, random weights), "
        f"{a['size']}x{a['size']}, {a['steps']} steps, {a['dtype']}, cgroup cap {cap}\n",
        f"Machine: {data['machine']['cpu_count']} CPUs, {data['machine']['memory_gib']} GiB, torch "
        f"{data['machine']['torch']}. Each row a fresh process, {a['rounds']} interleaved rounds, medians (the machine "
        "is shared: read the ratios). Page cache of the model and the store dropped before each run. Peak = the "
        "cgroup's max usage (RSS + page cache). Difference: largest per-pixel difference (0..255) from the uncapped "
        "reference image of the same round.\n",
        "| row | completed | seconds (median) | vs uncapped | cgroup peak (GiB) | max difference |",
        "|---|---|---|---|---|---|",
    ]
    reference = data["summary"].get(REFERENCE, {}).get("seconds")
    for row in data["rows"]:
        runs = [r for r in data["runs"] if r["row"] == row]
        s = data["summary"].get(row)
        done = f"{sum(r['completed'] for r in runs)}/{len(runs)}"
        if not runs:
            continue
        if not s:
            killed = sum(r["killed"] for r in runs)
            lines.append(f"| {row} | {done}" + (f" (killed {killed}x)" if killed else "") + " | | | "
                         f"{max(r['cgroup_peak_bytes'] for r in runs) / GiB:.2f} | |")
            continue
        ratio = f"{s['seconds'] / reference:.2f}x" if reference else "-"
        diff = "-" if s["max_difference"] is None else f"{s['max_difference']}/255"
        lines.append(f"| {row} | {done} | {s['seconds']:.1f} | {ratio} | {s['cgroup_peak_bytes'] / GiB:.2f} | {diff} |")
    notes = next((r.get("denoise_notes") for r in data["runs"] if r["row"] == WARM and r.get("denoise_notes")), None)
    if notes:
        lines += ["", "What the warm capped run's report says about its denoise stage:", "",
                  *[f"    {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-gib", type=float, default=2.0, help="the cgroup cap and the budget; 0: no cap, budget auto")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--models", default="/work/bench-models")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="openvino_budget")
    args = parser.parse_args()

    import torch
    from common import build_real_size, machine, max_difference, tiny_sd, write_outputs

    if args.tiny:
        model = tiny_sd(args.models)
        args.size = min(args.size, 64)
    else:
        file_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        model = build_real_size("sd15", Path(args.models) / f"sd15-{args.dtype}", file_dtype=file_dtype)
    work = Path(tempfile.mkdtemp(prefix="memfit-ov-budget-"))
    warm_store = work / "store"
    runs = []

    def save():
        summary = {}
        for row in ROWS:
            ok = [r for r in runs if r["row"] == row and r["completed"]]
            if ok:
                diffs = [r["max_difference"] for r in ok if r["max_difference"] is not None]
                summary[row] = {"seconds": statistics.median(r["seconds"] for r in ok),
                                "cgroup_peak_bytes": max(r["cgroup_peak_bytes"] for r in ok),
                                "max_difference": max(diffs) if diffs else None}
        data = {"args": vars(args), "machine": machine(), "runs": runs, "summary": summary, "rows": list(ROWS)}
        write_outputs(args.out, data, render(data))

    try:
        # Not recorded: fill the warm store with what the uncapped and the capped runs use.
        for row in (REFERENCE, WARM):
            measure(row, model, warm_store, work / "warmup.png", args)
        for round_index in range(args.rounds):
            images = {}
            for row in ROWS:
                store = work / f"cold-{round_index}" if row == COLD else warm_store
                images[row] = work / f"{round_index}-{ROWS.index(row)}.png"
                result = measure(row, model, store, images[row], args)
                if row == COLD:
                    shutil.rmtree(store, ignore_errors=True)
                result["max_difference"] = max_difference(images[row], images[REFERENCE]) if row != REFERENCE else 0
                runs.append({"row": row, "round": round_index, **result})
                print(row, round_index, {k: v for k, v in result.items() if k != "denoise_notes"}, flush=True)
                save()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
