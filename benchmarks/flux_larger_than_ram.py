"""Larger than memory with no flag: FLUX.1-dev (12B transformer, T5-XXL, CLIP-L, VAE; about 33.7 GB
of bf16 safetensors) on a machine with less RAM than that, memfit against plain diffusers (issue 13).

    # once, outside the repository (about 34 GB of disk; the builder checks free space first):
    python benchmarks/build_flux_random.py /work/bench-models/flux-dev-random
    # then (each run a fresh process in a child memory cgroup; results are written after every run):
    nice -n 19 python benchmarks/flux_larger_than_ram.py --model /work/bench-models/flux-dev-random \\
        --size 256 --steps 1 --runs memfit:none,memfit:12,diffusers:12,memfit:6,diffusers:6

A run is SYSTEM:CAP with CAP in GiB or "none" (no cap). memfit runs with **no budget flag**: the
automatic budget reads the cap from the run's own cgroup. Plain diffusers loads FluxPipeline in bf16
and calls it, as its documentation does. The page cache of the model is evicted before each run and
counts against the cap, so a run that merely re-reads its weights from disk is measured honestly.

Also measured in the same session: the disk's sequential read bandwidth, cold (page cache of one
transformer shard dropped first, read in 16 MiB chunks), so memfit's time per step can be set
against the bound the disk sets: bytes read from disk per step / bandwidth. Bytes per step come
from memfit's timeline (every block read from the disk tier in the denoise stage); the step's time
is the denoise stage's span from its first block read to its end.

Writes docs/flux_larger_than_ram.{json,md} after every run, so an interrupted session keeps what
finished. Runs that take longer than --timeout seconds are stopped and reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

GiB = 2**30
PROMPT = "a lighthouse at dusk"
GUIDANCE = 3.5


def heartbeat(interval: float = 10.0) -> None:
    """Every ``interval`` s, one stderr line: seconds, RSS, and the cgroup's rss / cache split, so a
    killed run still shows what grew (anonymous memory or page cache) and when."""
    import threading

    from memfit.testing.cgroup import own_memory_cgroup

    group = own_memory_cgroup()
    started = time.perf_counter()

    def beat():
        while True:
            time.sleep(interval)
            rss = next((int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:")), 0)
            stat = {}
            if group is not None:
                for line in (group / "memory.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    stat[key] = int(value)
            print(f"HEARTBEAT t={time.perf_counter() - started:.0f}s rss={rss / GiB:.2f}GiB "
                  f"cg_rss={stat.get('rss', 0) / GiB:.2f}GiB cg_cache={stat.get('cache', 0) / GiB:.2f}GiB "
                  f"cg_mapped={stat.get('mapped_file', 0) / GiB:.2f}GiB", file=sys.stderr, flush=True)

    threading.Thread(target=beat, daemon=True).start()


def child(system: str, model: str, size: int, steps: int, timeline_path: str | None, image_path: str | None) -> dict:
    """Inside the capped process: one generation, with its timings and peaks."""
    import torch

    heartbeat()

    from memfit.run.memory import read_peak_rss

    started = time.perf_counter()
    if system == "compute":
        return compute_per_step(size)
    if system == "memfit":
        import types

        import memfit

        step_times: dict[int, float] = {}

        def on_step(stage: str, done: int, total: int) -> None:
            if stage == "denoise":
                step_times.setdefault(done, time.perf_counter() - started)

        # memfit.generate reads only these two attributes of a session: no stage is kept warm here.
        watcher = types.SimpleNamespace(pool=None, on_step=on_step)
        result = memfit.generate(PROMPT, model=model, steps=steps, guidance=GUIDANCE, width=size, height=size,
                                 dtype="bf16", seed=0, progress=False, session=watcher)
        if image_path:
            result.images[0].save(image_path)
        timeline = result.timeline
        if timeline_path:  # a plot for docs/, the events (large) next to the model, outside the repository
            timeline.write(timeline_path)
            events = Path(model).parent / "timelines" / Path(timeline_path).with_suffix(".json").name
            events.parent.mkdir(exist_ok=True)
            timeline.write(events)
        denoise = next(s for s in timeline.stages if s.stage == "denoise")
        moves = [m for m in timeline.moves if m.stage == "denoise"]
        disk = [m for m in moves if m.from_tier == "disk"]
        # The timeline starts with memfit.generate, within milliseconds of ``started``.
        loop_start, loop_end = step_times[0], step_times[max(step_times)]
        loading = [x.rss for x in timeline.samples if denoise.start <= x.t <= loop_start]
        return {
            "wall_s": time.perf_counter() - started,
            "peak_rss": max(s.peak_bytes for s in result.report.stages),
            "stages": [{"stage": s.stage, "seconds": s.seconds, "peak_rss": s.peak_bytes,
                        "planned_peak": s.planned_peak_bytes, "strategy": s.strategy} for s in result.report.stages],
            "budget": result.report.budget,
            "notes": result.report.notes,
            "denoise_stage_s": denoise.end - denoise.start,
            "step_s": (loop_end - loop_start) / steps,
            "denoise_load_s": loop_start - denoise.start,
            "denoise_load_peak_rss": max(loading, default=None),
            "disk_bytes_per_step": sum(m.bytes for m in disk) / steps,
            "cgroup_peak_sampled": max((s.cgroup or 0 for s in timeline.samples), default=0),
        }
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    pipe = diffusers.FluxPipeline.from_pretrained(model, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - started
    load_peak = read_peak_rss()
    call_started = time.perf_counter()
    image = pipe(PROMPT, num_inference_steps=steps, guidance_scale=GUIDANCE, width=size, height=size,
                 generator=torch.Generator().manual_seed(0)).images[0]
    if image_path:
        image.save(image_path)
    return {"wall_s": time.perf_counter() - started, "load_s": load_s, "call_s": time.perf_counter() - call_started,
            "peak_rss": read_peak_rss(), "load_peak_rss": load_peak}


def compute_per_step(size: int, repeats: int = 3) -> dict:
    """What one denoising step costs with every weight already in memory: one double-stream and one
    single-stream block of FLUX.1-dev (random bf16 weights, 512 text tokens, the image's tokens), each
    timed (median of ``repeats`` after a warm-up) and multiplied by the 19 and 38 the transformer has.
    The rest of the transformer (embedders, final norm) is a few GFLOP and left out."""
    import statistics

    import torch
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    torch.manual_seed(0)
    dim, heads, head_dim, text_tokens = 3072, 24, 128, 512
    image_tokens = (size // 16) ** 2
    image = torch.randn(1, image_tokens, dim, dtype=torch.bfloat16)
    text = torch.randn(1, text_tokens, dim, dtype=torch.bfloat16)
    temb = torch.randn(1, dim, dtype=torch.bfloat16)
    timings = {}
    for name, block_class, count in (("double", FluxTransformerBlock, 19), ("single", FluxSingleTransformerBlock, 38)):
        block = block_class(dim, heads, head_dim).to(torch.bfloat16).eval()
        seconds = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                begun = time.perf_counter()
                block(hidden_states=image, encoder_hidden_states=text, temb=temb)
                seconds.append(time.perf_counter() - begun)
        timings[name] = {"block_s": statistics.median(seconds[1:]), "count": count}
        del block
    return {"blocks": timings, "step_s": sum(t["block_s"] * t["count"] for t in timings.values())}


def disk_bandwidth(model: str, nbytes: int = 4 * GiB) -> dict:
    """Cold sequential read of the largest transformer shard (its page cache dropped first)."""
    from memfit.testing.cgroup import evict_page_cache

    shard = max((Path(model) / "transformer").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    evict_page_cache(shard.parent)
    read, chunk = 0, 16 * 2**20
    started = time.perf_counter()
    with open(shard, "rb", buffering=0) as handle:
        while read < nbytes:
            data = handle.read(chunk)
            if not data:
                break
            read += len(data)
    seconds = time.perf_counter() - started
    evict_page_cache(shard.parent)
    return {"file": str(shard), "bytes": read, "seconds": seconds, "bytes_per_s": read / seconds}


def measure(spec: str, cap: float | None, args) -> dict:
    """One run of ``spec`` (memfit, diffusers, or either with "-fp16": the fp16 folder) in a fresh
    process under ``cap`` GiB (None: uncapped)."""
    from memfit.testing.cgroup import evict_page_cache, run_capped

    system, _, variant = spec.partition("-")
    model = args.fp16_model if variant == "fp16" else args.model
    docs = Path(__file__).resolve().parent.parent / "docs"
    timeline = docs / f"flux_timeline_{spec}_{'none' if cap is None else f'{cap:g}'}gib.png"
    command = [sys.executable, __file__, "--child", system, "--model", model, "--size", str(args.size),
               "--steps", str(args.steps)] + (["--timeline", str(timeline)] if system == "memfit" else [])
    image = Path(model).parent / "images" / f"{spec}_{'none' if cap is None else f'{cap:g}'}gib.png"
    image.parent.mkdir(exist_ok=True)
    image.unlink(missing_ok=True)
    command += ["--image", str(image)]
    evict_page_cache(model)
    env = {**os.environ, "MEMFIT_CACHE": "0"}  # every memfit run encodes its prompt like plain diffusers does
    row = {"system": spec, "cap_gib": cap}
    try:
        run = run_capped(command, int(cap * GiB) if cap else None, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**row, "completed": False, "killed": False, "timed_out": True, "timeout_s": args.timeout}
    result = next((json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
    row.update(completed=run.completed and result is not None, killed=run.killed, timed_out=False,
               returncode=run.returncode, cgroup_peak=run.max_usage_bytes, process_s=run.seconds, **(result or {}))
    if not row["completed"] and not run.killed:
        row["error"] = run.stderr.strip().splitlines()[-3:]
    lines = run.stderr.strip().splitlines()
    row["heartbeat"] = [line for line in lines if line.startswith("HEARTBEAT")][-60:]
    if row["completed"] and image.is_file():
        row["image"] = str(image)
    row["warnings"] = [line for line in lines if line.startswith("memfit: during")]
    return row


def render(data: dict) -> str:
    bw = data.get("disk")
    compute = (data.get("compute") or {}).get("step_s")
    lines = [
        "# FLUX.1-dev larger than RAM: memfit (no flag) and plain diffusers under cgroup caps",
        "",
        f"Real architecture (33.7 GB of bf16 safetensors), {data['args']['size']}x{data['args']['size']}, "
        f"{data['args']['steps']} step(s), guidance {GUIDANCE}, run in bf16, {data['machine'].get('cpu_count')} CPU cores, "
        f"{data['machine'].get('memory_gib')} GiB RAM, no swap. Page cache evicted before each run and charged to "
        "the cap. memfit runs with no `--budget`: its budget is detected from the run's own cgroup. "
        "Built by `benchmarks/build_flux_random.py`, run by `benchmarks/flux_larger_than_ram.py`.",
        "",
        "- `memfit`, `diffusers`: random bf16 weights. `-fp16`: the same folder with the transformer stored in "
        "fp16 (23.8 GB) and run in bf16, the common case of a published checkpoint; its file is sparse "
        "(zeros: memory does not depend on the values, but its reads never reach the disk, so its times "
        "are not disk-bound figures).",
        "- step: one denoising step, from the denoising loop's start to its end (the stage's load before it "
        "is the load column). compute: the same step with every weight in memory (one double- and one "
        "single-stream block timed, times 19 and 38). disk: bytes memfit read from the disk tier per step / "
        "the disk's cold sequential bandwidth. bound: the larger of the two, which a perfect overlap of "
        "reading and computing would reach.",
        "",
    ]
    if bw:
        lines += [f"Disk, cold sequential read: {bw['bytes_per_s'] / 1e6:.0f} MB/s ({bw['bytes'] / GiB:.1f} GiB in "
                  f"{bw['seconds']:.1f} s). Compute per step with every weight in memory: "
                  + (f"{compute:.0f} s." if compute else "not measured."), ""]
    lines += ["| run | cap | outcome | wall s | denoise load s / peak RSS | step s | disk bytes / step | disk s | "
              "compute s | step / bound | image vs memfit uncapped | peak RSS | cgroup peak | budget |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        cap = "none" if r["cap_gib"] is None else f"{r['cap_gib']:g} GiB"
        outcome = ("completed" if r.get("completed") else "killed (OOM)" if r.get("killed")
                   else f"stopped after {r.get('timeout_s')} s" if r.get("timed_out") else f"failed: {r.get('error')}")
        step = r.get("step_s")
        per_step = r.get("disk_bytes_per_step")
        disk = per_step / bw["bytes_per_s"] if per_step and bw else None
        bound = max(disk or 0, compute or 0) or None
        if r.get("denoise_load_s") is not None:
            load = f"{r['denoise_load_s']:.0f} / {(r.get('denoise_load_peak_rss') or 0) / GiB:.2f} GiB"
        elif r.get("load_s") is not None:  # plain diffusers: from_pretrained of the whole pipeline
            load = f"{r['load_s']:.0f} / {r['load_peak_rss'] / GiB:.2f} GiB (pipeline)"
        else:
            load = "-"
        lines.append("| " + " | ".join([
            r["system"], cap, outcome, f"{r['wall_s']:.0f}" if r.get("wall_s") else "-", load,
            f"{step:.0f}" if step else "-", f"{per_step / GiB:.1f} GiB" if per_step else "-",
            f"{disk:.0f}" if disk else "-", f"{compute:.0f}" if compute and step else "-",
            f"{step / bound:.2f}x" if step and bound and "fp16" not in r["system"] else "-",
            image_difference(r, data["rows"]),
            f"{r['peak_rss'] / GiB:.2f} GiB" if r.get("peak_rss") else "-",
            f"{r['cgroup_peak'] / GiB:.2f} GiB" if r.get("cgroup_peak") else "-",
            (r.get("budget") or {}).get("source", "-").replace("|", "/")]) + " |")
    memfit_rows = [r for r in data["rows"] if r["system"].startswith("memfit") and r.get("stages")]
    if memfit_rows:
        lines += ["", "memfit's stages (seconds / peak RSS / planned peak):", ""]
        for r in memfit_rows:
            cap = "none" if r["cap_gib"] is None else f"{r['cap_gib']:g} GiB"
            parts = [f"{s['stage']} {s['seconds']:.0f} s / {s['peak_rss'] / GiB:.2f} GiB / "
                     + ("-" if s["planned_peak"] is None else f"{s['planned_peak'] / GiB:.2f} GiB") for s in r["stages"]]
            lines.append(f"- {r['system']}, cap {cap}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def image_difference(row: dict, rows: list[dict]) -> str:
    """The largest pixel difference (of 255) between this run's image and memfit's uncapped one from
    the same folder."""
    import numpy as np
    from PIL import Image

    variant = row["system"].partition("-")[2]
    reference = next((r for r in rows if r["system"] == "memfit" + (f"-{variant}" if variant else "")
                      and r["cap_gib"] is None and r.get("image")), None)
    if not row.get("image") or reference is None or not Path(row["image"]).is_file():
        return "-"
    a, b = (np.asarray(Image.open(r["image"]).convert("RGB"), dtype=np.int16) for r in (row, reference))
    return f"{int(np.abs(a - b).max())}/255"


def plot_against_cap(data: dict, path: Path) -> None:
    """Wall time against the cap, one line per run kind; a killed run is a cross at its cap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ram = data["machine"].get("memory_gib") or 24
    for index, system in enumerate(sorted({r["system"] for r in data["rows"]})):
        rows = sorted((r for r in data["rows"] if r["system"] == system), key=lambda r: r["cap_gib"] or ram)
        done = [(r["cap_gib"] or ram, r["wall_s"]) for r in rows if r.get("completed")]
        killed = [r["cap_gib"] or ram for r in rows if r.get("killed")]
        color = f"C{index}"
        if done:
            ax.plot(*zip(*done), marker="o", color=color, label=system)
        if killed:
            ax.scatter(killed, [0] * len(killed), marker="x", s=80, color=color,
                       label=f"{system}: killed" if not done else None)
    ax.set_xlabel(f"memory cap, GiB (uncapped drawn at the machine's {ram:g} GiB)")
    ax.set_ylabel("wall time, s (a cross at 0: killed)")
    size, steps = data["args"]["size"], data["args"]["steps"]
    ax.set_title(f"FLUX.1-dev, {steps} step(s), {size}x{size}, bf16 run, {data['machine'].get('cpu_count')} CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/bench-models/flux-dev-random")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--runs", default="memfit:none,memfit:12,diffusers:12,memfit:6,diffusers:6",
                        help="SYSTEM:CAP pairs in order: SYSTEM memfit or diffusers (bf16 files), memfit-fp16 or "
                             "diffusers-fp16 (the --fp16-model folder); CAP in GiB or none")
    parser.add_argument("--fp16-model", default="/work/bench-models/flux-dev-fp16-sparse",
                        help="the folder the -fp16 runs load (benchmarks/build_flux_random.py --fp16-sparse-of)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped")
    parser.add_argument("--name", default="flux_larger_than_ram")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--timeline", help=argparse.SUPPRESS)
    parser.add_argument("--image", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.size, args.steps, args.timeline, args.image)),
              flush=True)
        return

    from common import machine, write_outputs

    from memfit.testing.cgroup import cgroup_unavailable_reason

    if not (Path(args.model) / "model_index.json").is_file():
        sys.exit(f"{args.model} is not built; run benchmarks/build_flux_random.py {args.model} first")
    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot cap memory here ({reason})")
    data = {"machine": machine(), "args": vars(args), "disk": disk_bandwidth(args.model), "rows": []}
    print(f"disk: {data['disk']['bytes_per_s'] / 1e6:.0f} MB/s cold sequential read", flush=True)
    compute = subprocess.run([sys.executable, __file__, "--child", "compute", "--size", str(args.size)],
                             capture_output=True, text=True, check=True)
    data["compute"] = next(json.loads(line[7:]) for line in compute.stdout.splitlines() if line.startswith("RESULT "))
    print(f"compute: {data['compute']['step_s']:.0f} s per step with every weight in memory", flush=True)
    for spec in args.runs.split(","):
        system, cap_text = spec.split(":")
        cap = None if cap_text == "none" else float(cap_text)
        row = measure(system, cap, args)
        data["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("notes", "stages", "heartbeat")}), flush=True)
        print("\n".join(row.get("heartbeat", [])[-8:]), flush=True)
        write_outputs(args.name, data, render(data))
        plot_against_cap(data, Path(__file__).resolve().parent.parent / "docs" / f"{args.name}.png")


if __name__ == "__main__":
    main()
