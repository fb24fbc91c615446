"""memfit's fixed overhead over plain diffusers: the same generation, each in a fresh process, side by
side under the same cgroup memory caps, with the time split into phases.

    python benchmarks/overhead.py --caps none,6 --rounds 3            # SD 1.5 fp32, 512x512, 2 steps
    python benchmarks/overhead.py --arch sdxl --dtype bf16 --size 512 --caps none
    python benchmarks/overhead.py --arch flux-width --dtype bf16 --size 64 --caps none,3,2,1.25

Each run is a fresh subprocess (imports included) in a child memory cgroup, the model's page cache
evicted first; rounds interleave the two systems (order alternating). memfit runs as a user runs it,
with no budget flag (the automatic budget; under a cap it sees the cap) and its cache on, in a store of
the benchmark's own: one unmeasured memfit run first hashes the model's files as a user's first run
does, and every pair of runs (one round, one cap) has a prompt of its own, so both encode every time.
Both compute with the same thread count (--threads, default 2).

Phases, timed the same way for both by a global forward pre-hook (the first call of each kind of
model): `start` (interpreter start to imports done), `to encode` (model loading and whatever runs
before the text encoder), `encode` (text encoder to the first UNet call: for memfit this includes
the denoise stage's loading and planning), `denoise` (first UNet call to the VAE decoder's first
call: includes the decode stage's loading), `decode` (to the image in hand). CPU seconds (user +
system) come from getrusage. Writes docs/overhead_<arch>_<dtype>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # as early as the child can take it: its imports count
sys.path.insert(0, str(Path(__file__).resolve().parent))

SYSTEMS = ("diffusers", "memfit")
PROMPT = "a lighthouse at dusk"
GiB = 2**30
PHASES = ("start", "to encode", "encode", "denoise", "decode")
# The first forward of each of these marks the start of a phase; the names cover the UNet and
# transformer families and the VAE decoders memfit's real-size architectures use.
MARKERS = {"CLIPTextModel": "encode", "CLIPTextModelWithProjection": "encode", "T5EncoderModel": "encode",
           "UNet2DConditionModel": "denoise", "FluxTransformer2DModel": "denoise", "Decoder": "decode"}


def run_child(system: str, model: str, prompt: str, dtype_name: str, size: int, steps: int, threads: int,
              image_out: str) -> dict:
    """Inside the capped child: one generation, its phases and CPU time."""
    import resource

    import torch

    torch.set_num_threads(threads)
    marks: dict[str, float] = {}

    def mark_first_forward(module, args):
        phase = MARKERS.get(type(module).__name__)
        if phase is not None and phase not in marks:
            marks[phase] = time.perf_counter()

    if system == "memfit":
        import memfit
    else:
        import diffusers
    imported = time.perf_counter()
    torch.nn.modules.module.register_module_forward_pre_hook(mark_first_forward)
    if system == "memfit":
        result = memfit.generate(prompt, model=model, steps=steps, guidance=7.5, width=size, height=size,
                                 dtype=dtype_name, progress=False, threads=threads)
        image = result.images[0]
        extra = {"strategies": [s.strategy for s in result.report.stages], "budget": result.report.budget.get("source")}
    else:
        from memfit.dtypes import parse_dtype

        diffusers.utils.logging.disable_progress_bar()
        pipe = diffusers.DiffusionPipeline.from_pretrained(model, torch_dtype=parse_dtype(dtype_name))
        pipe.set_progress_bar_config(disable=True)
        image = pipe(prompt, num_inference_steps=steps, guidance_scale=7.5, width=size, height=size,
                     generator=torch.Generator().manual_seed(0)).images[0]
        extra = {}
    finished = time.perf_counter()
    image.save(image_out)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    from memfit.run.memory import (
        process_peak_rss,  # memfit resets the kernel's peak at each stage: ru_maxrss
    )
    edges = [STARTED, imported, marks.get("encode"), marks.get("denoise"), marks.get("decode"), finished]
    phases = {name: (None if a is None or b is None else b - a) for name, a, b in zip(PHASES, edges, edges[1:])}
    return {"wall_s": finished - STARTED, "cpu_s": usage.ru_utime + usage.ru_stime, "user_s": usage.ru_utime,
            "system_s": usage.ru_stime, "minor_faults": usage.ru_minflt, "major_faults": usage.ru_majflt,
            "peak_rss": process_peak_rss(), "phases": phases, **extra}


def build_flux_width(folder: Path) -> Path:
    """A Flux pipeline whose transformer has FLUX.1's width (24 heads of 128) with 1 double and 4 single blocks
    (1.91 GB in bf16), beside memfit's tiny text encoders and VAE, saved in bf16: the denoiser's matmuls are
    Flux's, the rest costs little. Built once (seed 0); memory and speed do not depend on the weight values."""
    if (folder / "model_index.json").is_file():
        return folder
    import torch
    from diffusers import FluxTransformer2DModel

    from memfit.testing.pipelines import build_pipeline

    pipe = build_pipeline("flux", seed=0, scale=4)
    torch.manual_seed(0)
    width = pipe.text_encoder_2.config.d_model
    pipe.transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=pipe.transformer.config.in_channels, num_layers=1, num_single_layers=4,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=width,
        pooled_projection_dim=pipe.text_encoder.config.hidden_size, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    pipe.register_modules(transformer=pipe.transformer)
    pipe.to(torch.bfloat16).save_pretrained(folder)
    return folder


def measure(system: str, model: str, cap: float | None, args, prompt: str, image: str) -> dict:
    from memfit.testing.cgroup import evict_page_cache, run_capped

    command = [sys.executable, __file__, "--run", system, "--model", model, "--prompt", prompt, "--dtype", args.dtype, "--size",
               str(args.size), "--steps", str(args.steps), "--threads", str(args.threads), "--image-out", image]
    evict_page_cache(model)
    run = run_capped(command, int(cap * GiB) if cap else None, timeout=3600,
                     env={**os.environ, "MEMFIT_CACHE_DIR": args.cache_dir, "HF_HUB_OFFLINE": "1"})
    result = next((json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
    row = {"system": system, "cap_gib": cap, "completed": run.completed and result is not None, "killed": run.killed,
           "cgroup_peak": run.max_usage_bytes, "process_s": run.seconds, **(result or {})}
    if not row["completed"] and not run.killed:
        row["error"] = run.stderr.strip().splitlines()[-3:]
    return row


def summarize(rows: list[dict], caps: list) -> list[dict]:
    """Per cap: each system's medians, and memfit / diffusers per round (rounds pair the two runs made
    back to back) and of the medians."""
    summary = []
    for cap in caps:
        at_cap = [r for r in rows if r["cap_gib"] == cap]
        entry = {"cap_gib": cap}
        for system in SYSTEMS:
            done = [r for r in at_cap if r["system"] == system and r["completed"]]
            entry[system] = {
                "completed": f"{len(done)}/{sum(r['system'] == system for r in at_cap)}",
                "wall_s": _median(r["wall_s"] for r in done), "cpu_s": _median(r["cpu_s"] for r in done),
                "user_s": _median(r["user_s"] for r in done), "system_s": _median(r["system_s"] for r in done),
                # Set-up: interpreter start to the denoiser's first call (imports, loading, planning, encoding).
                "set_up_s": _median(sum(r["phases"][p] for p in PHASES[:3]) for r in done
                                    if all(r["phases"][p] is not None for p in PHASES[:3])),
                "cgroup_peak": _median(r["cgroup_peak"] for r in done), "peak_rss": _median(r["peak_rss"] for r in done),
                "phases": {p: _median(r["phases"][p] for r in done if r["phases"][p] is not None) for p in PHASES},
            }
        rounds = sorted({r["round"] for r in at_cap})
        ratios = []
        for round_ in rounds:
            pair = {r["system"]: r for r in at_cap if r["round"] == round_ and r["completed"]}
            if len(pair) == 2:
                ratios.append(pair["memfit"]["wall_s"] / pair["diffusers"]["wall_s"])
        entry["round_ratios"] = ratios
        both = entry["diffusers"]["wall_s"] and entry["memfit"]["wall_s"]
        entry["median_ratio"] = entry["memfit"]["wall_s"] / entry["diffusers"]["wall_s"] if both else None
        entry["cpu_ratio"] = entry["memfit"]["cpu_s"] / entry["diffusers"]["cpu_s"] if both else None
        summary.append(entry)
    return summary


def _median(values):
    values = list(values)
    return statistics.median(values) if values else None


def render(data: dict) -> str:
    args = data["settings"]
    lines = [
        f"# Fixed overhead: memfit against plain diffusers ({args['arch']} {args['dtype']}, {args['size']}x{args['size']}, "
        f"{args['steps']} steps)",
        "",
        f"`python benchmarks/overhead.py {data['command']}`. Each run a fresh process (imports counted) in a child memory "
        f"cgroup, page cache evicted first; {args['rounds']} rounds alternating which system goes first; memfit with no "
        "budget flag (automatic) and its cache on, in a store of the benchmark's own that one unmeasured first run "
        "filled (the files' hashes); a new prompt for each pair of runs, so both encode every time; both at "
        f"{args['threads']} torch threads. Machine: {data['machine']['cpu']}, "
        f"{data['machine']['cpu_count']} cores (shared with other work: read the per-round ratios, runs back to back, "
        "before the medians).",
        "",
        "| cap | system | completed | wall s | user s | system s | start | to encode | encode | set-up | denoise | decode "
        "| cgroup peak | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in data["summary"]:
        cap = "none" if entry["cap_gib"] is None else f"{entry['cap_gib']:g} GiB"
        for system in SYSTEMS:
            s = entry[system]
            cells = [_seconds(s["wall_s"]), _seconds(s["user_s"]), _seconds(s["system_s"]),
                     *(_seconds(s["phases"][p]) for p in PHASES[:3]), _seconds(s["set_up_s"]),
                     *(_seconds(s["phases"][p]) for p in PHASES[3:]), _gib(s["cgroup_peak"]), _gib(s["peak_rss"])]
            lines.append(f"| {cap} | {system} | {s['completed']} | " + " | ".join(cells) + " |")
    lines += ["", "| cap | memfit / diffusers, wall, per round | of the medians | user CPU, of the medians | set-up, of the medians |",
              "|---|---|---|---|---|"]
    for entry in data["summary"]:
        cap = "none" if entry["cap_gib"] is None else f"{entry['cap_gib']:g} GiB"
        rounds = ", ".join(f"{r:.3f}" for r in entry["round_ratios"]) or "-"
        median = "-" if entry["median_ratio"] is None else f"{entry['median_ratio']:.3f}"
        user = _ratio(entry["memfit"]["user_s"], entry["diffusers"]["user_s"])
        set_up = _ratio(entry["memfit"]["set_up_s"], entry["diffusers"]["set_up_s"])
        lines.append(f"| {cap} | {rounds} | {median} | {user} | {set_up} |")
    lines += ["", f"Images identical (memfit and diffusers, each cap): {data['images_identical']}.", ""]
    return "\n".join(lines)


def _ratio(ours, theirs) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.3f}"


def _seconds(value):
    return "-" if value is None else f"{value:.2f}"


def _gib(value):
    return "-" if value is None else f"{value / GiB:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd15", choices=("sd15", "sdxl", "flux-width"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--caps", default="none,6", help="GiB, comma-separated; 'none' = no cap")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "memfit-bench-models"))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: the capped child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--image-out", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    parser.add_argument("--rerender", action="store_true", help="rewrite docs/overhead_<arch>_<dtype>.md from its JSON")
    args = parser.parse_args()
    if args.rerender:
        from common import write_outputs

        name = f"overhead_{args.arch}_{args.dtype}"
        data = json.loads((Path(__file__).resolve().parent.parent / "docs" / f"{name}.json").read_text())
        caps = list(dict.fromkeys(r["cap_gib"] for r in data["rows"]))
        data["summary"] = summarize(data["rows"], caps)
        write_outputs(name, data, render(data))
        return
    if args.run:
        print("RESULT " + json.dumps(run_child(args.run, args.model, args.prompt, args.dtype, args.size, args.steps,
                                               args.threads, args.image_out)))
        return

    import numpy as np
    from common import build_real_size, machine
    from PIL import Image

    from memfit.dtypes import parse_dtype
    from memfit.testing.cgroup import cgroup_unavailable_reason

    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot cap memory here ({reason}); run where a child memory cgroup can be made")
    if args.arch == "flux-width":
        model = str(build_flux_width(Path(args.models) / "flux-width-bf16"))
    else:
        file_dtype = "fp32" if args.arch == "sd15" else "bf16"
        model = str(build_real_size(args.arch, Path(args.models) / f"{args.arch}-{file_dtype}",
                                    file_dtype=parse_dtype(file_dtype)))
    caps = [None if c.strip() == "none" else float(c) for c in args.caps.split(",")]
    images = Path(tempfile.mkdtemp(prefix="overhead-images-"))
    args.cache_dir = tempfile.mkdtemp(prefix="overhead-cache-")
    first = measure("memfit", model, None, args, PROMPT, str(images / "first.png"))  # hashes the files, unmeasured
    if not first["completed"]:
        sys.exit(f"memfit's first run failed: {first.get('error')}")
    rows = []
    for round_ in range(args.rounds):
        for cap in caps:
            for system in SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]:
                image = str(images / f"{system}-{cap}-{round_}.png")
                row = measure(system, model, cap, args, f"{PROMPT}, take {round_}, cap {cap}", image)
                row.update(round=round_, image=image)
                rows.append(row)
                print(f"round {round_} cap {cap} {system}: "
                      + (f"{row['wall_s']:.2f} s wall, {row['cpu_s']:.2f} s CPU" if row["completed"] else "did not complete"),
                      flush=True)
    identical = {}  # per cap: whether every round's two images (one prompt) are equal
    for cap in caps:
        for round_ in range(args.rounds):
            done = {r["system"]: r["image"] for r in rows if (r["cap_gib"], r["round"]) == (cap, round_) and r["completed"]}
            if len(done) == 2:
                same = np.array_equal(np.asarray(Image.open(done["memfit"])), np.asarray(Image.open(done["diffusers"])))
                key = "none" if cap is None else f"{cap:g}"
                identical[key] = identical.get(key, True) and bool(same)
    data = {"command": " ".join(sys.argv[1:]), "settings": {**vars(args), "model": model}, "machine": machine(),
            "rows": rows, "summary": summarize(rows, caps), "images_identical": identical}
    from common import write_outputs

    write_outputs(f"overhead_{args.arch}_{args.dtype}", data, render(data))


if __name__ == "__main__":
    main()
