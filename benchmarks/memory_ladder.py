"""Memory ladder: plain diffusers, diffusers' group offloading to disk, and memfit, each run under
a cgroup memory cap from a ladder, side by side in one script (issue 5's benchmark).

    python benchmarks/memory_ladder.py --arch sd15 --dtype fp32 --caps 1,1.5,2,2.5,3,4,6,none

Each run is a fresh subprocess in a child memory cgroup (page cache of the model evicted first
and counted against the cap). Per system and cap: completed or killed, wall time, cgroup peak
usage (RSS + page cache), peak RSS and load-time peak RSS of the process (VmHWM). Writes
docs/memory_ladder_<arch>_<dtype>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SYSTEMS = ("diffusers", "diffusers-group-offload-disk", "memfit")
GiB = 2**30


def run_one(system: str, model: str, dtype_name: str, size: int, steps: int, budget: str | None) -> dict:
    """Inside the capped child: one generation, with its own timings and peaks."""
    import torch

    from memfit.memory import _read_hwm

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
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
        return {"wall_s": time.perf_counter() - started, "peak_rss": stage_peak, "load_peak_rss": None,
                "notes": result.report.notes}
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
        load_peak = _read_hwm()
        pipe("a lighthouse at dusk", **kwargs)
    return {"wall_s": time.perf_counter() - started, "peak_rss": _read_hwm(), "load_peak_rss": load_peak, "notes": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd15", choices=("sd15", "sdxl"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--caps", default="1,1.5,2,2.5,3,4,6,none", help="GiB, comma-separated; 'none' = no cap")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "memfit-bench-models"))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: the capped child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--budget", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:
        print("RESULT " + json.dumps(run_one(args.run, args.model, args.dtype, args.size, args.steps, args.budget)))
        return

    from common import build_real_size, machine, write_outputs

    from memfit.testing.cgroup import cgroup_unavailable_reason, evict_page_cache, run_capped

    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot cap memory here ({reason}); run where a child memory cgroup can be made")
    model = str(build_real_size(args.arch, Path(args.models) / f"{args.arch}-fp32"))
    caps = [None if c.strip() == "none" else float(c) for c in args.caps.split(",")]
    rows = []
    for cap in caps:
        for system in args.systems.split(","):
            command = [sys.executable, __file__, "--run", system, "--model", model, "--dtype", args.dtype,
                       "--size", str(args.size), "--steps", str(args.steps)]
            if system == "memfit" and cap is not None:
                command += ["--budget", f"{cap}GiB"]
            evict_page_cache(model)
            run = run_capped(command, int(cap * GiB) if cap else None, timeout=3600)
            result = next((json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
            row = {"system": system, "cap_gib": cap, "completed": run.completed and result is not None, "killed": run.killed,
                   "returncode": run.returncode, "cgroup_peak": run.max_usage_bytes, "process_s": run.seconds, **(result or {})}
            if not row["completed"] and not run.killed:
                row["error"] = run.stderr.strip().splitlines()[-1:] 
            rows.append(row)
            status = "ok" if row["completed"] else ("killed" if run.killed else f"failed {row.get('error')}")
            print(f"cap {cap} GiB  {system:30s} {status:8s} wall {row.get('wall_s', 0):7.1f} s  "
                  f"cgroup peak {run.max_usage_bytes / GiB:5.2f} GiB  peak RSS {row.get('peak_rss', 0) / GiB:5.2f} GiB", flush=True)

    write_outputs(f"memory_ladder_{args.arch}_{args.dtype}", {"machine": machine(), "args": vars(args), "rows": rows},
                  render(rows, args.arch, args.dtype, args.size, args.steps))


def render(rows: list[dict], arch: str, dtype: str, size: int, steps: int) -> str:
    def gib(value):
        return "n/a" if value is None else f"{value / GiB:.2f}"

    header = "| cap | system | result | wall s | cgroup peak GiB | peak RSS GiB | load peak RSS GiB |\n|---|---|---|---|---|---|---|\n"
    lines = []
    for r in rows:
        result = "ok" if r["completed"] else ("killed" if r["killed"] else "failed")
        done = r["completed"]
        lines.append(
            f"| {r['cap_gib'] if r['cap_gib'] else 'none'} | {r['system']} | {result} | "
            f"{r['wall_s']:.1f} | " if done else f"| {r['cap_gib'] if r['cap_gib'] else 'none'} | {r['system']} | {result} | - | "
        )
        lines[-1] += f"{r['cgroup_peak'] / GiB:.2f} | {gib(r.get('peak_rss')) if done else '-'} | {gib(r.get('load_peak_rss')) if done else '-'} |"
    return (
        f"# Memory ladder: {arch}, {dtype}, {size}x{size}, {steps} steps, guidance 7.5\n\n"
        "Each run: a fresh process in a child memory cgroup; page cache evicted first and counted against the cap.\n"
        "Peak RSS counts memory-mapped weight pages too, so it can exceed a cap that the kernel enforces by\n"
        "dropping and re-reading those pages; the cgroup peak is the honest figure. memfit loads and runs one stage\n"
        "at a time, so it has no separate load-time peak.\n\n" + header + "\n".join(lines) + "\n"
    )


def rerender(json_path: str) -> None:
    """Re-write the markdown table of a recorded run (no new measurements)."""
    data = json.loads(Path(json_path).read_text())
    args = data["args"]
    Path(json_path).with_suffix(".md").write_text(render(data["rows"], args["arch"], args["dtype"], args["size"], args["steps"]))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rerender":
        rerender(sys.argv[2])
    else:
        main()
