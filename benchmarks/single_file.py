"""Single-file checkpoints (issue 31's numbers): an SDXL all-in-one checkpoint opened by memfit, streamed in
place from the file, under a 4 GiB memory cap with no budget flag; diffusers' own `from_single_file` under the
same cap; and the same checkpoint against the same model as a diffusers folder, uncapped.

    python benchmarks/single_file.py                 # SDXL, real size, 512x512, 2 steps, fp32, 3 rounds -> docs/single_file.{json,md}
    python benchmarks/single_file.py --tiny --rounds 1 --out single_file_tiny   # tiny SDXL: smoke-test the script
    python benchmarks/single_file.py --rerender      # docs/single_file.md again from docs/single_file.json

Rows, each a fresh process, interleaved over --rounds rounds:

  memfit file, capped                  memfit.generate(model=FILE, config=FOLDER), no budget given (auto: the cgroup's
                                       limit), under the cgroup cap
  diffusers from_single_file, capped   StableDiffusionXLPipeline.from_single_file(FILE, config=FOLDER,
                                       local_files_only=True, torch_dtype=float32) and one call, under the same cap
  memfit file, uncapped                as the first row, without the cap
  memfit folder, uncapped              memfit.generate(model=FOLDER): the same weights as a diffusers folder

Every row computes in fp32 (memfit's default dtype, which the file and folder rows keep; diffusers is given
torch_dtype=float32 to match) from the fp16 weights of the file or folder, at the same size, steps, guidance, prompt and seed. memfit
runs with MEMFIT_CACHE=0, so every run encodes its prompt, as diffusers does. Before each run the page cache of
the model's files is dropped, so every run reads them from disk and a capped run is charged for what it reads (a
cgroup cap counts page cache). Per run: completed or killed, seconds from opening the model to the first
denoising step (memfit), to open the model and generate (in the process, imports excluded) and from launch to
exit, the cgroup's peak (RSS + page cache) and the process's peak RSS (memfit.process_peak_rss(); for a run
killed before it could say, the largest high-water mark a thread of the run had reported, read every 0.2 s, a
lower bound), and the image's largest difference from the folder's image of the same round (0..255).

The model lives outside the repository, under --models, built when absent (about 5 minutes and 16 GiB of
RAM on a 2-core CPU, once): benchmarks/common.py's real-size SDXL (memfit.models.archs; random weights, seed 0)
saved as a diffusers folder in fp16 at MODELS/sdxl-fp16, then written as one all-in-one LDM checkpoint (about
6.9 GB) at MODELS/sdxl-fp16-single-file/sdxl-fp16.safetensors by memfit.testing.single_file.save_single_file.
Delete either to rebuild it; `--build-only` builds and exits. The folder is also the file's --config (its
configs and tokenizers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30
PROMPT = "a lighthouse at dusk"
GUIDANCE = 5.0
MEMFIT_FILE_CAPPED = "memfit file, capped"
DIFFUSERS_CAPPED = "diffusers from_single_file, capped"
MEMFIT_FILE = "memfit file, uncapped"
MEMFIT_FOLDER = "memfit folder, uncapped"
ROWS = (MEMFIT_FILE_CAPPED, DIFFUSERS_CAPPED, MEMFIT_FILE, MEMFIT_FOLDER)
CAPPED = (MEMFIT_FILE_CAPPED, DIFFUSERS_CAPPED)
RATIOS = ("first_step_seconds", "seconds", "peak_rss")  # file / folder, per round


def build_model(models: Path, tiny: bool) -> tuple[Path, Path]:
    """The SDXL diffusers folder (fp16) and the all-in-one checkpoint written from it, built when absent."""
    import torch

    from memfit.testing.single_file import save_single_file

    name = "sdxl-tiny-fp16" if tiny else "sdxl-fp16"
    # The file in a folder of its own: its page cache is dropped by folder, as the diffusers folder's is.
    folder, file = models / name, models / f"{name}-single-file" / f"{name}.safetensors"
    if tiny:
        from memfit.testing import save_pipeline

        if not (folder / "model_index.json").is_file():
            save_pipeline("sdxl_single_file", folder, dtype=torch.float16)
    else:
        from common import build_real_size

        build_real_size("sdxl", folder, file_dtype=torch.float16)
    if not file.is_file():
        started = time.perf_counter()
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_suffix(".partial")
        # dtype: diffusers loads the fp16 folder's UNet and VAE in fp32 unless told otherwise.
        save_single_file(folder, partial, dtype=torch.float16)
        partial.rename(file)  # a build cut short leaves no file that looks whole
        print(f"wrote {file} ({file.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s", flush=True)
    return folder, file


def report_peaks() -> None:
    """In the child: print the process's largest memory high-water mark so far every 0.2 s, so a run killed by
    the cap still leaves its peak behind (memfit resets the kernel's mark at each stage: hence the max)."""
    def poll():
        highest = 0
        while True:
            status = Path("/proc/self/status").read_text().splitlines()
            fields = dict(line.split(":", 1) for line in status if ":" in line)
            now = max(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("VmHWM", "VmRSS"))
            if now > highest + 16 * 2**20:
                highest = now
                print(f"PEAK {highest}", flush=True)
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()


def run_child(row: str, folder: str, file: str, size: int, steps: int, image_out: str) -> dict:
    """Inside the fresh process: open the model, generate one image, save it; the seconds and peaks."""
    report_peaks()  # before the imports: a run the cap kills while importing torch still says how far it got
    import torch

    import memfit

    started = time.perf_counter()
    if row == DIFFUSERS_CAPPED:
        import diffusers

        diffusers.utils.logging.disable_progress_bar()
        pipe = diffusers.StableDiffusionXLPipeline.from_single_file(file, config=folder, local_files_only=True,
                                                                    torch_dtype=torch.float32)
        opened = time.perf_counter() - started
        pipe.set_progress_bar_config(disable=True)
        image = pipe(PROMPT, num_inference_steps=steps, guidance_scale=GUIDANCE, width=size, height=size,
                     generator=torch.Generator().manual_seed(0)).images[0]
        extra = {"open_seconds": opened}
    else:
        model, config = (folder, None) if row == MEMFIT_FOLDER else (file, folder)
        first_step = []

        def on_step(stage, done, total):
            if done == 0 and not first_step:  # the denoising loop starts: model open, prompt encoded, UNet loaded
                first_step.append(time.perf_counter() - started)

        result = memfit.generate(PROMPT, model=model, config=config, steps=steps, guidance=GUIDANCE, width=size,
                                 height=size, seed=0, progress=False, on_step=on_step)
        image = result.images[0]
        extra = {"first_step_seconds": first_step[0], "budget": result.report.budget,
                 "stages": [{"stage": s.stage, "seconds": round(s.seconds, 2), "peak_rss": s.peak_bytes,
                             "strategy": s.strategy} for s in result.report.stages]}
    seconds = time.perf_counter() - started
    image.save(image_out)
    return {"seconds": seconds, "peak_rss": memfit.process_peak_rss(), **extra}


def measure(row: str, folder: Path, file: Path, image: Path, args) -> dict:
    """One run of ``row`` in a fresh process (under the cap where the row says so)."""
    from memfit.testing.cgroup import evict_page_cache, run_capped

    for where in (folder, file.parent):
        evict_page_cache(where)
    image.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--run", row, "--folder", str(folder), "--file", str(file),
               "--size", str(args.size), "--steps", str(args.steps), "--image-out", str(image)]
    env = {**os.environ, "MEMFIT_CACHE": "0", "HF_HUB_OFFLINE": "1"}
    run = run_capped(command, int(args.cap_gib * GiB) if row in CAPPED else None, timeout=args.timeout, env=env)
    lines = run.stdout.splitlines()
    result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
    peaks = [int(line[5:]) for line in lines if line.startswith("PEAK ")]
    out = {"completed": run.completed and result is not None and image.is_file(), "killed": run.killed,
           "returncode": run.returncode, "process_seconds": run.seconds, "cgroup_peak": run.max_usage_bytes,
           **(result or {})}
    if result is None:
        out["peak_rss"] = max(peaks, default=None)
        out["peak_rss_polled"] = True
    if not out["completed"] and not run.killed:
        out["error"] = (run.stderr.strip().splitlines() or ["(no output)"])[-1][-300:]
    return out


def summarize(runs: list[dict]) -> dict:
    """Per row: rounds completed and killed; over the completed rounds the median seconds and the largest peaks
    (over every round for the cgroup peak, a killed one included). Per round and median: file / folder."""
    rows = {}
    for row in ROWS:
        mine = [r for r in runs if r["row"] == row]
        if not mine:
            continue
        done = [r for r in mine if r["completed"]]
        peaks = [r["peak_rss"] for r in mine if r.get("peak_rss")]
        rows[row] = {"rounds": len(mine), "completed": len(done), "killed": sum(r["killed"] for r in mine),
                     "cgroup_peak": max(r["cgroup_peak"] for r in mine), "peak_rss": max(peaks, default=None)}
        if done:
            rows[row].update({key: statistics.median(r[key] for r in done)
                              for key in ("seconds", "first_step_seconds", "process_seconds") if key in done[0]})
    ratios = []
    for round_index in sorted({r["round"] for r in runs}):
        pair = {r["row"]: r for r in runs if r["round"] == round_index and r["completed"]}
        if MEMFIT_FILE in pair and MEMFIT_FOLDER in pair:
            file, folder = pair[MEMFIT_FILE], pair[MEMFIT_FOLDER]
            ratios.append({"round": round_index, **{key: file[key] / folder[key] for key in RATIOS}})
    median = {key: statistics.median(r[key] for r in ratios) for key in RATIOS} if ratios else None
    return {"rows": rows, "file_over_folder": ratios, "file_over_folder_median": median}


def render(data: dict) -> str:
    from memfit.sizes import format_bytes

    a, m, s = data["args"], data["machine"], data["summary"]

    def gib(value):
        return "-" if value is None else f"{value / GiB:.2f}"

    model = ("memfit.testing's tiny SDXL" if a["tiny"] else "benchmarks/common.py's real-size SDXL") + \
        " (random weights)"
    lines = [
        f"# Single-file checkpoints: SDXL ({'tiny' if a['tiny'] else 'real size'}, random fp16 weights), "
        f"{a['size']}x{a['size']}, {a['steps']} steps, fp32, cgroup cap {a['cap_gib']:g} GiB\n",
        f"Machine: {m['cpu']}; {m['cpu_count']} CPUs, {m['memory_gib']} GiB, torch {m['torch']}. The model: "
        f"{model} saved in fp16 as a diffusers folder and written from it as one all-in-one LDM checkpoint of "
        f"{format_bytes(data['file_bytes'])} (memfit.testing.single_file."
        "save_single_file); the folder is the file's `config` for memfit and diffusers alike.\n",
        f"Each run a fresh process, {a['rounds']} interleaved rounds. Every row computes in fp32 (memfit's default) "
        f"at guidance {GUIDANCE:g} from the same prompt and seed; memfit with no budget given (auto: under the cap, "
        "the cgroup's limit) and its prompt cache off. The page cache of the model's files is dropped before each "
        "run. First step: seconds from opening the model to the first denoising step (the model opened, the "
        "prompt encoded, the UNet loaded or planned); seconds: opening the model and generating, in the process "
        "(imports excluded); process: launch to exit. The file and folder rows swap places every other round. Cgroup peak: the cgroup's max usage (RSS + page cache; the kernel reclaims page cache under the "
        "cap), largest over the rounds. Peak RSS: memfit.process_peak_rss() at the end of the run, largest over "
        "the rounds; for a killed run (marked >=), the largest high-water mark its own thread had reported, read "
        "every 0.2 s: a lower bound. The peak RSS may exceed the cgroup peak: it counts the pages of torch's "
        "libraries that earlier processes had already read, which are charged to them. memfit's budget: the one "
        "auto resolved (the device tier, RAM on this CPU), largest over the rounds. Difference: the image's "
        "largest per-pixel difference (0..255) from the memfit folder row's image of the same round.\n",
        "| row | completed | first step s (median) | seconds (median) | process s (median) | cgroup peak GiB | "
        "peak RSS GiB | memfit's budget GiB | max difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, r in s["rows"].items():
        runs = [x for x in data["runs"] if x["row"] == row]
        done = f"{r['completed']}/{r['rounds']}" + (f" (killed {r['killed']}x)" if r["killed"] else "")
        polled = not r["completed"] and r["peak_rss"] is not None
        diffs = [x["max_difference"] for x in runs if x.get("max_difference") is not None]
        budgets = [x["budget"]["budget"]["device"] for x in runs if (x.get("budget") or {}).get("budget")]
        first = f"{r['first_step_seconds']:.1f}" if "first_step_seconds" in r else "-"
        lines.append(f"| {row} | {done} | {first} | {r['seconds']:.1f} | {r['process_seconds']:.1f} | "
                     if r["completed"] else f"| {row} | {done} | - | - | - | ")
        lines[-1] += (f"{gib(r['cgroup_peak'])} | {'>= ' if polled else ''}{gib(r['peak_rss'])} | "
                      f"{gib(max(budgets)) if budgets else '-'} | {max(diffs) if diffs else '-'} |")
    errors = {x["row"]: x["error"] for x in data["runs"] if x.get("error")}
    lines += [f"\n{row} failed: `{error}`" for row, error in errors.items()]
    if s["file_over_folder"]:
        lines += ["", "The single file against the same model as a diffusers folder (memfit, uncapped), per round:", "",
                  "| round | first step s, file / folder | seconds, file / folder | peak RSS, file / folder |",
                  "|---|---|---|---|"]
        for label, r in [*((r["round"], r) for r in s["file_over_folder"]), ("median", s["file_over_folder_median"])]:
            lines.append(f"| {label} | " + " | ".join(f"{r[key]:.3f}x" for key in RATIOS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-gib", type=float, default=4.0)
    parser.add_argument("--tiny", action="store_true", help="the tiny SDXL of memfit.testing (a smoke test)")
    parser.add_argument("--models", default="/work/bench-models")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped")
    parser.add_argument("--out", default="single_file")
    parser.add_argument("--build-only", action="store_true", help="build the model when absent, then exit")
    parser.add_argument("--rerender", action="store_true", help="rewrite docs/<out>.md from docs/<out>.json")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: the child process of one run
    for internal in ("--folder", "--file", "--image-out"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.rerender:
        path = Path(__file__).resolve().parent.parent / "docs" / f"{args.out}.json"
        path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
        return
    if args.run:
        print("RESULT " + json.dumps(run_child(args.run, args.folder, args.file, args.size, args.steps,
                                               args.image_out)), flush=True)
        return

    from common import machine, max_difference, write_outputs

    from memfit.testing.cgroup import cgroup_unavailable_reason

    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot cap memory here ({reason}); run where a child memory cgroup can be made")
    folder, file = build_model(Path(args.models), args.tiny)
    if args.build_only:
        return
    if args.tiny:
        args.size = min(args.size, 64)
    images = Path(tempfile.mkdtemp(prefix="memfit-single-file-"))
    runs = []
    try:
        for round_index in range(args.rounds):
            paths = {row: images / f"{round_index}-{ROWS.index(row)}.png" for row in ROWS}
            # The uncapped pair swaps places every other round: neither always runs after the other.
            for row in ROWS if round_index % 2 == 0 else (*CAPPED, MEMFIT_FOLDER, MEMFIT_FILE):
                result = measure(row, folder, file, paths[row], args)
                runs.append({"row": row, "round": round_index, **result})
                print(row, round_index, {k: v for k, v in result.items() if k != "stages"}, flush=True)
            for run in runs[-len(ROWS):]:
                run["max_difference"] = max_difference(paths[run["row"]], paths[MEMFIT_FOLDER])
            data = {"args": vars(args), "machine": machine(), "file_bytes": file.stat().st_size, "rows": list(ROWS),
                    "runs": runs, "summary": summarize(runs)}
            write_outputs(args.out, data, render(data))  # after every round: a run cut short keeps what it measured
    finally:
        for path in images.iterdir():
            path.unlink()
        images.rmdir()


if __name__ == "__main__":
    main()
