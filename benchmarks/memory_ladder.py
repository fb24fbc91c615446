"""Memory ladder: plain diffusers, diffusers' group offloading to disk, and memfit, each run under
a cgroup memory cap from a ladder, side by side in one script (issue 5's benchmark).

    python benchmarks/memory_ladder.py --arch sd15 --dtype fp32 --caps 1,1.5,2,2.5,3,4,6,none
    python benchmarks/memory_ladder.py --systems memfit --caps 1,1.25,1.5,2,none --keep-earlier  # memfit rows only

Each run is a fresh subprocess in a child memory cgroup (page cache of the model evicted first
and counted against the cap). Per system and cap: completed or killed, wall time, cgroup peak
usage (RSS + page cache), peak RSS and load-time peak RSS of the process (VmHWM); for memfit, its
strategies and its image's difference from its uncapped image. Writes
docs/memory_ladder_<arch>_<dtype>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SYSTEMS = ("diffusers", "diffusers-group-offload-disk", "memfit")
GiB = 2**30


def run_one(system: str, model: str, dtype_name: str, size: int, steps: int, budget: str | None,
            image_out: str | None = None) -> dict:
    """Inside the capped child: one generation, with its own timings and peaks (the image saved to
    ``image_out``, for memfit, so the parent can compare it with the uncapped run's)."""
    import torch

    from memfit.run.memory import read_peak_rss
    from memfit.dtypes import parse_dtype

    dtype = parse_dtype(dtype_name)
    started = time.perf_counter()
    kwargs = dict(num_inference_steps=steps, guidance_scale=7.5, width=size, height=size,
                  generator=torch.Generator().manual_seed(0))
    if system == "memfit":
        import memfit

        result = memfit.generate("a lighthouse at dusk", model=model, steps=steps, guidance=7.5, width=size, height=size,
                                 dtype=dtype_name, budget=budget, progress=False)
        # memfit resets VmHWM at each stage, so the process peak is the largest stage's peak;
        # stages load and run one at a time, so there is no separate load-time peak.
        stage_peak = max(s.peak_bytes for s in result.report.stages)
        stages = [{"stage": s.stage, "seconds": s.seconds, "peak_rss": s.peak_bytes, "planned_peak": s.planned_peak_bytes,
                   "strategy": s.strategy} for s in result.report.stages]
        if image_out:
            result.images[0].save(image_out)
        return {"wall_s": time.perf_counter() - started, "peak_rss": stage_peak, "load_peak_rss": None,
                "stages": stages, "notes": result.report.notes}
    else:
        import diffusers

        diffusers.utils.logging.disable_progress_bar()
        pipe = diffusers.DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        if system == "diffusers-group-offload-disk":
            offload_dir = tempfile.mkdtemp(prefix="group-offload-")
            for name, component in pipe.components.items():
                if hasattr(component, "enable_group_offload"):
                    component.enable_group_offload(
                        onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1,
                        offload_to_disk_path=f"{offload_dir}/{name}",
                    )
        load_peak = read_peak_rss()
        pipe("a lighthouse at dusk", **kwargs)
    return {"wall_s": time.perf_counter() - started, "peak_rss": read_peak_rss(), "load_peak_rss": load_peak, "notes": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd15", choices=("sd15", "sdxl"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="run dtype")
    parser.add_argument("--file-dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of the saved weights")
    parser.add_argument("--caps", default="1,1.5,2,2.5,3,4,6,none", help="GiB, comma-separated; 'none' = no cap")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over every cap and system")
    parser.add_argument("--name", help="output name under docs/ (default memory_ladder_<arch>_<dtype>)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "memfit-bench-models"))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: the capped child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--budget", help=argparse.SUPPRESS)
    parser.add_argument("--image-out", help=argparse.SUPPRESS)
    parser.add_argument("--keep-earlier", action="store_true",
                        help="keep the recorded rows (docs/<name>.json) of every (cap, system) this run does not measure")
    args = parser.parse_args()

    if args.run:
        print("RESULT " + json.dumps(run_one(args.run, args.model, args.dtype, args.size, args.steps, args.budget,
                                             args.image_out)))
        return

    from common import build_real_size

    from memfit.testing.cgroup import cgroup_unavailable_reason

    # Every memfit run encodes its prompt like the others do: a prompt-embedding cache hit left
    # by the previous run would skip memfit's encode stage and flatter it.
    os.environ["MEMFIT_CACHE"] = "0"
    args.prompt_cache = "off"
    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot cap memory here ({reason}); run where a child memory cgroup can be made")
    from memfit.dtypes import parse_dtype

    file_dtype = parse_dtype(args.file_dtype)
    model = str(build_real_size(args.arch, Path(args.models) / f"{args.arch}-{args.file_dtype}", file_dtype=file_dtype))
    caps = [None if c.strip() == "none" else float(c) for c in args.caps.split(",")]
    args.images = tempfile.mkdtemp(prefix="memory-ladder-images-")
    name = args.name or f"memory_ladder_{args.arch}_{args.dtype}"
    earlier = earlier_rows(name, set()) if args.keep_earlier else []
    rows = []
    for round_ in range(args.repeat):  # rounds interleave systems and caps, so machine noise hits all alike
        for cap in caps:
            for system in args.systems.split(","):
                row = measure_capped(system, model, cap, args)
                row["round"] = round_
                rows.append(row)
                status = "ok" if row["completed"] else ("killed" if row["killed"] else f"failed {row.get('error')}")
                print(f"round {round_} cap {cap} GiB  {system:30s} {status:8s} wall {row.get('wall_s', 0):7.1f} s  "
                      f"cgroup peak {row['cgroup_peak'] / GiB:5.2f} GiB  peak RSS {row.get('peak_rss', 0) / GiB:5.2f} GiB",
                      flush=True)
        write_recorded(rows, args, earlier)  # after every round: a long ladder cut short keeps what it measured
    shutil.rmtree(args.images, ignore_errors=True)
    plot(write_recorded(rows, args, earlier), args.name or f"memory_ladder_{args.arch}_{args.dtype}", vars(args))


def write_recorded(rows: list[dict], args, earlier: list[dict]) -> list[dict]:
    """docs/<name>.{json,md} for the rows so far (and the earlier rows kept); returns all of them."""
    from common import machine, write_outputs

    compare_images(rows)
    measured = {(row["cap_gib"], row["system"]) for row in rows}
    everything = rows + [row for row in earlier if (row["cap_gib"], row["system"]) not in measured]
    name = args.name or f"memory_ladder_{args.arch}_{args.dtype}"
    write_outputs(name, {"machine": machine(), "args": vars(args), "rows": everything}, render(everything, vars(args)))
    return everything


def earlier_rows(name: str, measured: set) -> list[dict]:
    """The recorded rows of docs/<name>.json for the (cap, system) pairs not in ``measured``, marked so."""
    path = Path(__file__).resolve().parent.parent / "docs" / f"{name}.json"
    if not path.is_file():
        return []
    kept = [dict(row, earlier_run=True) for row in json.loads(path.read_text())["rows"]
            if (row["cap_gib"], row["system"]) not in measured]
    return kept


def compare_images(rows: list[dict]) -> None:
    """Each memfit row's largest pixel difference from the uncapped memfit run of its round."""
    import numpy as np
    from PIL import Image

    def pixels(row):
        return np.asarray(Image.open(row["image"]), dtype=int) if row.get("image") and Path(row["image"]).is_file() else None

    for row in rows:
        if row["system"] != "memfit":
            continue
        reference = next((r for r in rows if r["system"] == "memfit" and r["cap_gib"] is None
                          and r["round"] == row["round"] and r["completed"]), None)
        if reference is None or not row["completed"]:
            continue
        mine, theirs = pixels(row), pixels(reference)
        if mine is not None and theirs is not None:
            row["image_max_diff"] = int(np.abs(mine - theirs).max())
            row["image_mean_diff"] = float(np.abs(mine - theirs).mean())


def measure_capped(system: str, model: str, cap: float | None, args) -> dict:
    """One run of ``system`` in a fresh process under ``cap`` GiB (None: uncapped)."""
    from memfit.testing.cgroup import evict_page_cache, run_capped

    command = [sys.executable, __file__, "--run", system, "--model", model, "--dtype", args.dtype,
               "--size", str(args.size), "--steps", str(args.steps)]
    image = None
    if system == "memfit":
        image = str(Path(args.images) / f"{cap or 'none'}-{time.monotonic_ns()}.png")
        command += ["--image-out", image]
    if system == "memfit" and cap is not None:
        command += ["--budget", f"{cap}GiB"]
    evict_page_cache(model)
    run = run_capped(command, int(cap * GiB) if cap else None, timeout=3600)
    for leftover in Path(tempfile.gettempdir()).glob("group-offload-*"):
        shutil.rmtree(leftover, ignore_errors=True)  # a killed run cannot clean up its offload files
    result = next((json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
    row = {"system": system, "cap_gib": cap, "completed": run.completed and result is not None, "killed": run.killed,
           "returncode": run.returncode, "cgroup_peak": run.max_usage_bytes, "process_s": run.seconds, "image": image,
           **(result or {})}
    if not row["completed"] and not run.killed:
        row["error"] = run.stderr.strip().splitlines()[-1:]
    return row


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (cap, system) over the rounds: how many rounds completed; over those, the median
    wall time (every one kept in ``walls``) and the largest peaks."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["cap_gib"], row["system"]), []).append(row)
    out = []
    for runs in groups.values():
        done = [r for r in runs if r["completed"]]
        first = dict(done[0] if done else runs[0])
        first["rounds"], first["rounds_ok"] = len(runs), len(done)
        first["completed"] = bool(done)
        first["killed"] = any(r["killed"] for r in runs)
        first["cgroup_peak"] = max(r["cgroup_peak"] for r in runs)
        if done:
            diffs = [r["image_max_diff"] for r in done if r.get("image_max_diff") is not None]
            if diffs:
                first["image_max_diff"] = max(diffs)
            first["walls"] = [round(r["wall_s"], 1) for r in done]
            first["wall_s"] = statistics.median(r["wall_s"] for r in done)
            first["peak_rss"] = max(r["peak_rss"] for r in done)
            first["stages"] = [s for r in done for s in r.get("stages", [])]
        out.append(first)
    return out


def render(rows: list[dict], args: dict) -> str:
    def gib(value):
        return "-" if value is None else f"{value / GiB:.2f}"

    rounds = args.get("repeat", 1)
    lines = [
        f"# Memory ladder: {args['arch']}, {args['dtype']} run from {args.get('file_dtype', 'fp32')} files, "
        f"{args['size']}x{args['size']}, {args['steps']} steps, guidance 7.5",
        "",
        "Each run: a fresh process in a child memory cgroup (cgroup v1 memory.limit_in_bytes); the model's page cache",
        "is evicted first and counted against the cap. memfit runs with its budget set to the cap. Peak RSS is the",
        "kernel's high-water mark (VmHWM); memfit resets it per stage and reports the largest stage. The cgroup peak",
        "includes page cache, which the kernel reclaims under a cap. memfit loads and runs one stage at a time, so",
        "it has no separate load-time peak. Planned peak: memfit's predicted peak RSS for its largest stage (process",
        "memory at stage start + resident weights + the running streamed block + activations; the block read ahead",
        "is page cache, which the plan fits into the budget too); error = (measured - planned) / planned, worst stage.",
        "",
        "memfit ran with MEMFIT_CACHE=0, so every run encoded its prompt." if args.get("prompt_cache") == "off" else
        "memfit's prompt cache was on in this run: runs after the first reused the prompt embeddings and skipped "
        "the encode stage (under 1 s instead of several).",
        *([f"{rounds} rounds, interleaved; wall s is the median (every round's in the JSON), peaks the largest."]
          if rounds > 1 else []),
        "x uncapped: wall time over the same system's uncapped wall time. memfit's strategies: denoise / decode",
        "(memfit.plan.activations). Image: memfit's largest pixel difference (0-255) from its uncapped image of the",
        "same round, worst round.",
        *(["Rows marked 'earlier run' are kept from the previous recording of this page (not re-measured)."]
          if any(r.get("earlier_run") for r in rows) else []),
        *([f"Note: {args['note']}."] if args.get("note") else []),
        "",
        "| cap GiB | system | result | wall s | x uncapped | cgroup peak GiB | peak RSS GiB | load peak RSS GiB | "
        "planned peak GiB | plan error | strategies | image diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    table = aggregate(rows)
    uncapped = {r["system"]: r["wall_s"] for r in table if r["cap_gib"] is None and r["completed"]}
    for r in sorted(table, key=lambda r: (r["cap_gib"] is None, r["cap_gib"] or 0, _system_order(r["system"]))):
        done = r["completed"]
        result = "ok" if done else ("killed" if r["killed"] else "failed")
        if 0 < r.get("rounds_ok", 1) < r.get("rounds", 1):
            result = f"ok {r['rounds_ok']}/{r['rounds']}, killed {r['rounds'] - r['rounds_ok']}/{r['rounds']}"
        if r.get("earlier_run"):
            result += " (earlier run)"
        planned, error = _plan_accuracy(r) if done else (None, None)
        wall = f"{r['wall_s']:.1f}" if done else "-"
        ratio = f"{r['wall_s'] / uncapped[r['system']]:.2f}" if done and r["system"] in uncapped else "-"
        strategies = " / ".join(dict.fromkeys(s["strategy"] for s in r.get("stages", [])
                                              if s["stage"] in ("denoise", "decode") and s.get("strategy")))
        diff = r.get("image_max_diff")
        lines.append(
            f"| {r['cap_gib'] or 'none'} | {r['system']} | {result} | {wall} | {ratio} | "
            f"{r['cgroup_peak'] / GiB:.2f} | {gib(r.get('peak_rss')) if done else '-'} | "
            f"{gib(r.get('load_peak_rss')) if done else '-'} | {gib(planned)} | "
            f"{'-' if error is None else f'{error:+.0%}'} | {strategies or '-'} | {'-' if diff is None else diff} |"
        )
    return "\n".join(lines) + "\n"


def _system_order(system: str) -> int:
    return SYSTEMS.index(system) if system in SYSTEMS else len(SYSTEMS)


def _plan_accuracy(row: dict) -> tuple[int | None, float | None]:
    """The largest planned stage peak, and the worst relative error of any planned stage."""
    stages = [s for s in row.get("stages", []) if s.get("planned_peak")]
    if not stages:
        return None, None
    worst = max(stages, key=lambda s: abs(s["peak_rss"] - s["planned_peak"]) / s["planned_peak"])
    return max(s["planned_peak"] for s in stages), (worst["peak_rss"] - worst["planned_peak"]) / worst["planned_peak"]


def plot(rows: list[dict], name: str, args: dict) -> None:
    """Wall time against cap per system (killed runs marked at the bottom); docs/<name>.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install memfit[bench]); no plot written")
        return
    caps = sorted({r["cap_gib"] for r in rows if r["cap_gib"]})
    uncapped_at = (max(caps) if caps else 1) * 1.25
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = aggregate(rows)
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        done = sorted((r["cap_gib"] or uncapped_at, r["wall_s"]) for r in mine if r["completed"])
        killed = [r["cap_gib"] or uncapped_at for r in mine if not r["completed"]]
        line = ax.plot([x for x, _ in done], [y for _, y in done], marker="o", label=system)[0]
        ax.scatter(killed, [0] * len(killed), marker="x", color=line.get_color(), s=60)
    ax.set_xticks(caps + [uncapped_at], [f"{c:g}" for c in caps] + ["none"])
    ax.set_xlabel("memory cap (GiB); x at 0 = killed")
    ax.set_ylabel("wall time (s)")
    ax.set_title(f"{args['arch']} {args['dtype']} {args['size']}x{args['size']}, {args['steps']} steps")
    ax.legend()
    fig.tight_layout()
    path = Path(__file__).resolve().parent.parent / "docs" / f"{name}.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def rerender(json_path: str) -> None:
    """Re-write the markdown table of a recorded run (no new measurements)."""
    data = json.loads(Path(json_path).read_text())
    args = data["args"]
    Path(json_path).with_suffix(".md").write_text(render(data["rows"], args))
    plot(data["rows"], Path(json_path).stem, args)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rerender":
        rerender(sys.argv[2])
    else:
        main()
