"""memfit side by side with stable-diffusion.cpp: the same all-in-one SD 1.5 file, the same size, steps and
thread count, each run a fresh process, first at the file's precision and then quantized.

    python benchmarks/sdcpp.py --sd /work/sdcpp/build/bin/sd-cli \\
        --file /work/bench-models/sd15-fp32.safetensors --config /work/bench-models/sd15-fp32 \\
        --size 512 --steps 4 --rounds 2 --types q8_0,q4_0

The checkpoint: the diffusers folder written as an A1111-style all-in-one file (LDM keys) by memfit's writer,
which checks that diffusers' converters give the folder's tensors back:

    python -c "from memfit.testing.single_file import save_single_file as s; \
        s('/work/bench-models/sd15-fp32', '/work/bench-models/sd15-fp32.safetensors')"

stable-diffusion.cpp's `sd-cli`: `cmake -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target sd-cli`
in its source (here the copy the stable-diffusion-cpp-python sdist vendors). It reads the A1111-style checkpoint and quantizes it as it
loads with `--type q8_0` / `q4_0` (every run: it keeps nothing). memfit reads the same file (configs and
tokenizer from `--config`, a diffusers folder of the family) and quantizes its UNet with `--quantize
unet=q8_0`, once, into its cache: one unmeasured memfit run per type (one step) first fills a cache of the benchmark's
own (the file's hash and the quantized UNet), as a user's first run does; the measured runs map that file.

memfit's default budget ("auto") keeps the resident quantized weights dequantized where the machine has room
(it runs as fast as unquantized, holding both); `--memfit-budget 4.5GiB` adds a memfit row per type under that
budget, which leaves less room for them.

Rounds interleave every configuration (order reversed every other round), page cache evicted before each run,
each in a child memory cgroup (cap: --cap, default none) for its peak (RSS + page cache charged to it).
Peak RSS: sd.cpp's from the kernel (ru_maxrss of the child); memfit's from memfit.run.memory.process_peak_rss
(memfit resets the kernel's high-water mark at each stage). Wall: the whole process (memfit: interpreter
start, imports included; sd.cpp: the binary). Denoise: sd.cpp's "sampling completed" line, memfit's denoise
stage (its loading and planning included). The two sample differently (sd.cpp's Euler and RNG, memfit the
folder's EulerDiscreteScheduler): the images are not compared. Writes docs/sdcpp_sd15.{json,md}.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # as early as the child can take it: its imports count

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = "a lighthouse at dusk"
GUIDANCE = 7.5
GiB = 2**30
# sd.cpp's log lines (src/stable-diffusion.cpp, src/model.cpp) -> the row's fields, in seconds.
SDCPP_TIMES = {"load_s": r"loading tensors completed, taking ([\d.]+)s",
               "encode_s": r"get_learned_condition completed, taking ([\d.]+)s",
               "denoise_s": r"sampling completed, taking ([\d.]+)s",
               "decode_s": r"decode_first_stage completed, taking ([\d.]+)s",
               "generate_s": r"generate_image completed in ([\d.]+)s"}
SDCPP_PARAMS = re.compile(r"total params memory size = ([\d.]+)MB .*text_encoders ([\d.]+)MB.*diffusion_model ([\d.]+)MB"
                          r".*vae ([\d.]+)MB")


def sdcpp_command(args, precision: str, image: str, prompt: str = PROMPT) -> list[str]:
    command = [args.sd, "-m", args.file, "-p", prompt, "-W", str(args.size), "-H", str(args.size), "--steps",
               str(args.steps), "--cfg-scale", str(GUIDANCE), "--sampling-method", "euler", "--scheduler", "discrete",
               "-s", "0", "-t", str(args.threads), "-o", image, "-v"]
    return command + ([] if precision == "file" else ["--type", precision])


def memfit_cli(args, precision: str, budget: str | None) -> list[str]:
    """The `memfit generate` line the child's memfit.generate call equals."""
    command = ["memfit", "generate", "--model", args.file, "--config", args.config, "--prompt", PROMPT, "--steps",
               str(args.steps), "--guidance", str(GUIDANCE), "--width", str(args.size), "--height", str(args.size),
               "--threads", str(args.threads), "--out", "out.png"]
    if precision != "file":
        command += ["--quantize", f"unet={precision}"]
    return command + ([] if budget is None else ["--budget", budget])


def run_memfit_child(options: dict) -> dict:
    """Inside the measured child: one memfit generation, its stage times and peak RSS."""
    import resource

    import torch

    torch.set_num_threads(options["threads"])
    import memfit
    from memfit.run.memory import process_peak_rss

    result = memfit.generate(options["prompt"], model=options["file"], config=options["config"], steps=options["steps"],
                             guidance=GUIDANCE, width=options["size"], height=options["size"], progress=False,
                             threads=options["threads"], budget=options["budget"] or "auto",
                             quantize=None if options["precision"] == "file" else {"unet": options["precision"]})
    finished = time.perf_counter()
    result.images[0].save(options["image"])
    stages = {s.stage: s for s in result.report.stages}
    notes = [n for n in result.report.notes if "dequantized" in n]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": finished - STARTED, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss": process_peak_rss(),
            "encode_s": stages["encode"].seconds if "encode" in stages else None,
            "denoise_s": stages["denoise"].seconds if "denoise" in stages else None,
            "decode_s": stages["decode"].seconds if "decode" in stages else None,
            "unet_weights": stages["denoise"].weights_bytes if "denoise" in stages else None, "notes": notes}


def run_sdcpp_child(command: list[str]) -> dict:
    """Inside the measured child: sd.cpp's binary, its own timings from its log, its peak RSS from the kernel."""
    import resource

    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    log = done.stdout + done.stderr
    if done.returncode != 0:
        sys.stderr.write(log[-4000:])
        sys.exit(done.returncode)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss": usage.ru_maxrss * 1024}
    for field, pattern in SDCPP_TIMES.items():
        found = re.search(pattern, log)
        row[field] = float(found.group(1)) if found else None
    params = SDCPP_PARAMS.search(log)
    if params:
        row["params_mb"] = dict(zip(("total", "text_encoder", "unet", "vae"), map(float, params.groups())))
    return row


def measure(config: dict, args, image: str, prompt: str) -> dict:
    from memfit.testing.cgroup import evict_page_cache

    if config["system"] == "sd.cpp":
        child = [sys.executable, __file__, "--child-sdcpp", json.dumps(sdcpp_command(args, config["precision"], image,
                                                                                       prompt))]
    else:
        options = {"file": args.file, "config": args.config, "steps": args.steps, "size": args.size,
                   "threads": args.threads, "precision": config["precision"], "budget": config["budget"],
                   "image": image, "prompt": prompt}
        child = [sys.executable, __file__, "--child-memfit", json.dumps(options)]
    evict_page_cache(args.file)  # the file alone: its folder holds other models
    evict_page_cache(args.cache_dir)  # memfit's quantized UNet is read afresh too
    env = {**os.environ, "MEMFIT_CACHE_DIR": args.cache_dir, "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(args.threads)}
    return capped_row(child, config, args.cap, timeout=3600, env=env)


def capped_row(child: list[str], fields: dict, cap_gib: float | None, *, timeout: float, env: dict) -> dict:
    """Run ``child`` in a memory cgroup capped at ``cap_gib`` (None: no cap) and make its row: ``fields``, how it
    ended, its cgroup peak and seconds, the figures its RESULT line printed, and where it failed unkilled the last
    lines of its stderr."""
    from memfit.testing.cgroup import run_capped

    run = run_capped(child, None if cap_gib is None else int(cap_gib * GiB), timeout=timeout, env=env)
    result = next((json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")), None)
    row = {**fields, "completed": run.completed and result is not None, "killed": run.killed,
           "cgroup_peak": run.max_usage_bytes, "process_s": run.seconds, **(result or {})}
    if not row["completed"] and not run.killed:
        row["error"] = (run.stderr.strip().splitlines() or ["(no output)"])[-3:]
    return row


def configurations(types: list[str], memfit_budget: str) -> list[dict]:
    configs = [{"system": "sd.cpp", "precision": "file", "budget": None},
               {"system": "memfit", "precision": "file", "budget": None}]
    for kind in types:
        configs += [{"system": "sd.cpp", "precision": kind, "budget": None},
                    {"system": "memfit", "precision": kind, "budget": None}]
        if memfit_budget:
            configs.append({"system": "memfit", "precision": kind, "budget": memfit_budget})
    return configs


def label(config: dict) -> str:
    if config["system"] == "sd.cpp":
        return "sd.cpp" + ("" if config["precision"] == "file" else f" --type {config['precision']}")
    name = "memfit" + ("" if config["precision"] == "file" else f" --quantize unet={config['precision']}")
    return name + (f" --budget {config['budget']}" if config["budget"] else "")


def summarize(rows: list[dict], configs: list[dict]) -> list[dict]:
    summary = []
    for config in configs:
        runs = [r for r in rows if all(r[k] == config[k] for k in ("system", "precision", "budget"))]
        done = [r for r in runs if r["completed"]]
        entry = {**config, "label": label(config), "completed": f"{len(done)}/{len(runs)}"}
        for field in ("wall_s", "cpu_s", "encode_s", "denoise_s", "decode_s", "peak_rss", "cgroup_peak"):
            entry[field] = _median(r.get(field) for r in done)
        entry["step_s"] = None if entry["denoise_s"] is None else entry["denoise_s"] / rows[0]["steps"]
        entry["params_mb"] = next((r["params_mb"] for r in done if r.get("params_mb")), None)
        entry["notes"] = next((r["notes"] for r in done if r.get("notes")), [])
        summary.append(entry)
    return summary


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def render(data: dict) -> str:
    s = data["settings"]
    cap = "no cap" if s["cap"] is None else f"a {s['cap']:g} GiB cap"
    lines = [
        f"# memfit and stable-diffusion.cpp, SD 1.5 ({s['size']}x{s['size']}, {s['steps']} steps, {s['threads']} threads)",
        "",
        (f"`python benchmarks/sdcpp.py {data['command']}`. Both read the same all-in-one checkpoint, "
        f"`{Path(s['file']).name}` ({data['file_bytes'] / 2**30:.2f} GiB, {s['file_dtype']}, random weights: speed "
        "and memory do not depend on the values), at guidance 7.5 (both run the unconditional pass). "
        f"stable-diffusion.cpp: {data['sdcpp_version']}, built for the CPU "
        "(`cmake -DCMAKE_BUILD_TYPE=Release`, ggml's native CPU flags and OpenMP), `sd-cli -t "
        f"{s['threads']}`; it quantizes as it loads (`--type`: the UNet's and the text encoder's weights it can; "
        "its own log below says what each holds) at every run. memfit: `--quantize unet=TYPE` (the UNet's linear layers and 2-D "
        f"convolutions but its first and last; the text encoder and the VAE stay fp32), quantized once into its cache before the measured runs; torch at "
        f"{s['threads']} threads. Each run a fresh process in a child memory cgroup ({cap}), the file evicted "
        f"from the page cache first; {s['rounds']} rounds, every configuration once a round, the order reversed "
        f"every other round. Machine: {data['machine']['cpu']}, {data['machine']['cpu_count']} cores, shared with "
        "other work: wall times are noisy, CPU seconds (user + system) less so, memory not at all."),
        "",
        "The images differ (different samplers and noise): only time and memory are compared.",
        "",
        "| configuration | completed | wall s | CPU s | encode s | denoise s | s / step | decode s | peak RSS | cgroup peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in data["summary"]:
        cells = [_seconds(e["wall_s"]), _seconds(e["cpu_s"]), _seconds(e["encode_s"]), _seconds(e["denoise_s"]), _seconds(e["step_s"]),
                 _seconds(e["decode_s"]), _gib(e["peak_rss"]), _gib(e["cgroup_peak"])]
        lines.append(f"| {e['label']} | {e['completed']} | " + " | ".join(cells) + " |")
    lines += ["", *data.get("remarks", []), "", "Per run (round, configuration, wall s, peak RSS):", ""]
    for r in data["rows"]:
        lines.append(f"- round {r['round']}: {label(r)}: "
                     + (f"{r['wall_s']:.1f} s, {_gib(r['peak_rss'])}" if r["completed"] else
                        "killed" if r["killed"] else f"failed ({r.get('error')})"))
    params = [e for e in data["summary"] if e["params_mb"]]
    if params:
        lines += ["", "sd.cpp's own count of its weights in memory (its log's `total params memory size`):", ""]
        for e in params:
            p = e["params_mb"]
            lines.append(f"- {e['label']}: {p['total']:.0f} MB (text encoder {p['text_encoder']:.0f}, UNet "
                         f"{p['unet']:.0f}, VAE {p['vae']:.0f})")
    noted = [e for e in data["summary"] if e["notes"]]
    if noted:
        lines += ["", "memfit's notes on its quantized weights:", ""]
        lines += [f"- {e['label']}: {'; '.join(e['notes'])}" for e in noted]
    lines += ["", "Commands (the image path varies per run):", ""]
    for e in data["summary"]:
        lines.append(f"- {e['label']}: `{' '.join(data['commands'][e['label']])}`")
    lines.append("")
    return "\n".join(lines)


def _seconds(value):
    return "-" if value is None else f"{value:.2f}"


def _gib(value):
    return "-" if value is None else f"{value / GiB:.2f} GiB"


def sdcpp_version(binary: str, origin: str) -> str:
    try:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout.strip()
    except OSError as exc:
        version = f"({exc})"
    return f"{origin}; `sd-cli --version`: {version or '(none)'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sd", help="stable-diffusion.cpp's sd-cli binary")
    parser.add_argument("--sd-origin", default="stable-diffusion.cpp as vendored in the stable-diffusion-cpp-python "
                        "0.4.7 sdist (ggml 0.9.8; the sdist records no commit)", help="where the binary's source came from")
    parser.add_argument("--file", help="an all-in-one SD 1.5 checkpoint both read")
    parser.add_argument("--file-dtype", default="fp32")
    parser.add_argument("--config", help="a diffusers SD 1.5 folder: memfit's configs and tokenizer")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="q8_0,q4_0", help="quantized types, comma-separated ('' for none)")
    parser.add_argument("--memfit-budget", default="", help="a budget for a second memfit row per quantized type")
    parser.add_argument("--cap", type=float, default=None, help="a cgroup memory cap in GiB for every run")
    parser.add_argument("--cache-dir", help="memfit's cache for the runs (default: a new one; the first runs fill it)")
    parser.add_argument("--warm-up", help="the precisions ('file', types) of the unmeasured first runs "
                        "(default: all; '' for none, where --cache-dir holds them already)")
    parser.add_argument("--name", default="sdcpp_sd15", help="docs/NAME.{json,md}")
    parser.add_argument("--child-memfit", help=argparse.SUPPRESS)
    parser.add_argument("--child-sdcpp", help=argparse.SUPPRESS)
    parser.add_argument("--rerender", action="store_true", help="rewrite docs/NAME.md from its JSON")
    args = parser.parse_args()
    if args.child_memfit:
        print("RESULT " + json.dumps(run_memfit_child(json.loads(args.child_memfit))))
        return
    if args.child_sdcpp:
        print("RESULT " + json.dumps(run_sdcpp_child(json.loads(args.child_sdcpp))))
        return
    from common import write_outputs

    if args.rerender:
        data = json.loads((Path(__file__).resolve().parent.parent / "docs" / f"{args.name}.json").read_text())
        write_outputs(args.name, data, render(data))
        return
    if not (args.sd and args.file and args.config):
        parser.error("--sd, --file and --config are needed")
    from memfit.testing.cgroup import cgroup_unavailable_reason

    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot run in a memory cgroup here ({reason})")
    types = [t for t in args.types.split(",") if t]
    configs = configurations(types, args.memfit_budget)
    images = Path(tempfile.mkdtemp(prefix="sdcpp-images-"))
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="sdcpp-cache-")
    warm_up = ["file", *types] if args.warm_up is None else [p for p in args.warm_up.split(",") if p]
    for precision in warm_up:
        # the file's hash, and each quantized UNet, into the cache: unmeasured
        first = measure({"system": "memfit", "precision": precision, "budget": None}, argparse.Namespace(
            **{**vars(args), "steps": 1}), str(images / f"first-{precision}.png"), f"{PROMPT}, first run")
        if not first["completed"]:
            sys.exit(f"memfit's first {precision} run failed: {first.get('error')}")
        print(f"memfit's first {precision} run (unmeasured): {first['wall_s']:.1f} s", flush=True)
    rows = []
    for round_ in range(args.rounds):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            image = str(images / f"{label(config).replace(' ', '_').replace('/', '')}-{round_}.png")
            # A prompt of its own for every run: memfit's cache keeps a prompt's embeddings, and a repeated
            # prompt would skip its encode stage where sd.cpp encodes.
            prompt = f"{PROMPT}, take {round_}, {label(config)}"
            row = measure(config, args, image, prompt)
            row.update(round=round_, steps=args.steps, prompt=prompt)
            rows.append(row)
            print(f"round {round_} {label(config)}: "
                  + (f"{row['wall_s']:.1f} s wall, denoise {row.get('denoise_s')}, peak RSS {_gib(row['peak_rss'])}"
                     if row["completed"] else f"did not complete {row.get('error')}"), flush=True)
        _write(args, configs, rows)  # after every round: a run cut short keeps the rounds it finished


def _write(args, configs: list[dict], rows: list[dict]) -> None:
    from common import machine, write_outputs

    commands = {}
    for config in configs:
        commands[label(config)] = (sdcpp_command(args, config["precision"], "out.png") if config["system"] == "sd.cpp"
                                   else memfit_cli(args, config["precision"], config["budget"]))
    data = {"command": " ".join(sys.argv[1:]), "settings": {k: v for k, v in vars(args).items() if not k.startswith("child")},
            "machine": machine(), "sdcpp_version": sdcpp_version(args.sd, args.sd_origin),
            "file_bytes": Path(args.file).stat().st_size, "rows": rows, "summary": summarize(rows, configs),
            "commands": commands}
    write_outputs(args.name, data, render(data))


if __name__ == "__main__":
    main()
