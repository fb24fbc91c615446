"""Peak memory of compiled backends on the CPU (issue 18): SD 1.5 or SDXL architecture, random weights.

    python benchmarks/openvino_memory.py                    # 512x512, 4 steps, 2 rounds -> docs/openvino_memory.{json,md}
    python benchmarks/openvino_memory.py --arch sdxl --model /work/bench-models/sdxl-bf16 --size 1024 --dtype bf16
    python benchmarks/openvino_memory.py --dtype bf16 --rounds 3
    python benchmarks/openvino_memory.py --tiny             # tiny pipeline, seconds: smoke-test the script
    python benchmarks/openvino_memory.py --rerender docs/openvino_vs_optimum.json   # table and plot again

Rows, each a fresh process, interleaved over --rounds rounds (every other round in the reverse order, so that
no row always runs right after the same other one: what a process leaves in the page cache favours the next):

  diffusers eager      from_pretrained + __call__ (the baseline every other row is compared with)
  memfit openvino cold memfit.generate(backend="openvino") on an empty memfit store (compiles every component)
  memfit openvino warm the same on the store the cold run filled (imports the compiled models)
  memfit openvino cold, LABEL   with --baseline-src DIR: the cold row again, on an empty store of its own, with
                       memfit imported from DIR (another checkout's src/, e.g. the commit before a change), so that
                       before and after come from the same run (--baseline-label names it; default "before")
  memfit openvino session  a memfit.Session on the warm store: later images reuse the loaded stages
                       (memfit's best choice for a stream of images)
  memfit openvino session, budget B   with --session-budget B: the same Session under that budget, which keeps
                       stages loaded only while the next stage still fits beside them (else it reloads each
                       stage per image from the warm store)
  optimum-intel static / dynamic   with --optimum-python: optimum-intel's OVDiffusionPipeline on an IR
                       exported once by `optimum-cli export openvino` (--optimum-ir), with its shapes fixed by
                       reshape() before compile() (static, its fastest mode) or left dynamic; run in
                       optimum-intel's own environment (benchmarks/optimum_intel_child.py), never memfit's:
                           python -m venv OPT && OPT/bin/pip install torch==2.13.0 "optimum-intel[openvino]" diffusers psutil
                           OPT/bin/pip uninstall -y torchvision   # it pulls one built for another torch
                           OPT/bin/optimum-cli export openvino --model MODEL --task text-to-image --weight-format fp16 IR
                       (fp16: without it, a model over 1B parameters, the SDXL UNet, is exported with 8-bit weights;
                       a smaller one, SD 1.5, with fp32 weights: --optimum-fp16-ir adds a row for its fp16 export)

Per row: peak RSS of the process (ru_maxrss, which counts pages of mapped files the process touched; for
memfit rows memfit.process_peak_rss(), the same figure with what memfit's per-stage resets of it discarded),
seconds from launch to the first image, and the steady time per image: the median of images 2..N made
in the same process (--images N; diffusers: further __call__s; memfit warm: further memfit.generate
calls, each loading its stages again; the Session and optimum-intel: further images from what they
hold). Budgets are "none" (what each system holds when nothing limits it) except in the row that names one.
--store reuses an existing memfit store (kept afterwards) instead of a fresh one that the cold row fills.
--page-cache warm reads every file a row reads (memfit: the model folder, then the store; optimum-intel: its IR)
before launching it, so that no row's first image depends on what the row before pushed out of the page cache
(optimum-intel's SDXL process, 15.6 GiB, pushes out memfit's 4.8 GiB compiled UNet; memfit's does not push out
optimum-intel's IR); cold drops those files of every row from the page cache instead (posix_fadvise; a VM's host may
still hold them). Default: as the row before left it.

Slow on a small machine: keep --steps and --rounds small (4 and 2 by default), and say so in the doc.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = "a lighthouse at dusk"
GUIDANCE = 7.5
ROWS = ("diffusers eager", "memfit openvino cold", "memfit openvino warm")
BASELINE_ROW = "memfit openvino cold, {}"
SESSION_ROW = "memfit openvino session"
SESSION_BUDGET_ROW = SESSION_ROW + ", budget {}"
OPTIMUM_ROWS = ("optimum-intel static", "optimum-intel dynamic")
OPTIMUM_FP16_ROW = "optimum-intel static, fp16 IR"
ARCH_NAMES = {"sd15": "SD 1.5", "sdxl": "SDXL"}
PAGE_CACHE_NOTES = {
    "as-left": "Each row starts with the page cache the row before left (every other round in the reverse order). ",
    "warm": "Each row starts with its own files read into the page cache just before it (memfit: the model folder "
            "and the store; optimum-intel: its IR), so no first image depends on what the row before pushed out. ",
    "cold": "Each row starts with every row's files dropped from the page cache (posix_fadvise; the VM's host may "
            "still hold them). ",
}


def child(spec: dict) -> dict:
    import torch

    launched = spec["launched"]
    size, steps, images = spec["size"], spec["steps"], spec["images"]
    times = []
    if spec["system"] == "diffusers":
        import diffusers

        from memfit.dtypes import parse_dtype

        diffusers.utils.logging.disable_progress_bar()
        pipe = diffusers.DiffusionPipeline.from_pretrained(spec["model"], torch_dtype=parse_dtype(spec["dtype"]))
        pipe.set_progress_bar_config(disable=True)
        for _ in range(images):
            pipe(PROMPT, num_inference_steps=steps, guidance_scale=GUIDANCE, width=size, height=size,
                 generator=torch.Generator().manual_seed(0))
            times.append(time.time())
    elif spec.get("session"):
        from memfit.run.session import Session

        session = Session(spec["model"], dtype=spec["dtype"], budget=spec["budget"], backend="openvino")
        for _ in range(images):
            session.generate(PROMPT, steps=steps, guidance=GUIDANCE, width=size, height=size,
                             precision=spec.get("precision"))
            times.append(time.time())
    else:
        import memfit

        for _ in range(images):
            memfit.generate(PROMPT, model=spec["model"], steps=steps, guidance=GUIDANCE, width=size, height=size,
                            dtype=spec["dtype"], backend="openvino", budget="none", progress=False,
                            precision=spec.get("precision"))
            times.append(time.time())
    last_stretch = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if spec["system"] == "diffusers":
        peak = last_stretch
    else:
        # memfit resets the high-water mark ru_maxrss reads at every stage: read alone it is the last stage's
        from memfit import process_peak_rss

        peak = process_peak_rss()
    later = [after - before for before, after in zip(times, times[1:])]
    return {"first_image_s": times[0] - launched, "steady_image_s": statistics.median(later), "later_images_s": later,
            "peak_rss_bytes": peak, "ru_maxrss_bytes": last_stretch}


def run_child(spec: dict, env: dict) -> dict:
    spec = {**spec, "launched": time.time()}
    run = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         env=env, timeout=3600)
    line = next((l for l in reversed(run.stdout.splitlines()) if l.startswith("RESULT ")), None)
    if run.returncode != 0 or line is None:
        return {"ok": False, "error": (run.stderr.strip().splitlines() or ["(no output)"])[-1][-300:]}
    return {"ok": True, **json.loads(line[7:])}


def run_optimum(python: str, ir: str, static: bool, args) -> dict:
    """One optimum-intel row in its own environment's Python (it times itself from process start)."""
    spec = {"ir": ir, "static": static, "width": args.size, "height": args.size, "steps": args.steps,
            "guidance": GUIDANCE, "seed": 0, "precision": args.dtype, "prompt": PROMPT, "images": args.images,
            "out": str(Path(tempfile.gettempdir()) / f"optimum-{'static' if static else 'dynamic'}.npy")}
    child_script = Path(__file__).resolve().parent / "optimum_intel_child.py"
    run = subprocess.run([python, str(child_script), json.dumps(spec)], capture_output=True, text=True, timeout=3600)
    line = next((l for l in reversed(run.stdout.splitlines()) if l.startswith("{")), None)
    if run.returncode != 0 or line is None:
        return {"ok": False, "error": (run.stderr.strip().splitlines() or ["(no output)"])[-1][-300:]}
    return {"ok": True, **json.loads(line)}


def _row_files(row: str, model: Path, store: str, args) -> list[Path]:
    """The files a row reads, in the order to read them (what is read last stays cached longest)."""
    if row == OPTIMUM_FP16_ROW:
        folders = [Path(args.optimum_fp16_ir)]
    elif row in OPTIMUM_ROWS:
        folders = [Path(args.optimum_ir)]
    elif row.startswith("diffusers"):
        folders = [model]
    else:
        folders = [model, Path(store)]
    return [file for folder in folders for file in sorted(folder.rglob("*")) if file.is_file()]


def set_page_cache(policy: str, files: list[Path]) -> None:
    """warm: read ``files`` into the page cache; cold: drop them from it."""
    buffer = bytearray(16 * 2**20)
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            if policy == "cold":
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while handle.readinto(buffer):
                    pass


def _paired_ratios(runs: list[dict], ours: str, theirs: str) -> list[tuple[int, float, float]]:
    """(round, first image ratio, steady image ratio) of ``ours`` against ``theirs`` in each round both completed."""
    by_round = {(r["row"], r["round"]): r for r in runs if r["ok"]}
    return [(index, mine["first_image_s"] / other["first_image_s"], mine["steady_image_s"] / other["steady_image_s"])
            for (row, index), mine in sorted(by_round.items(), key=lambda item: item[0][1])
            if row == ours and (other := by_round.get((theirs, index)))]


def render(data: dict) -> str:
    a = data["args"]
    lines = [
        f"# Peak memory with compiled backends: {ARCH_NAMES[a.get('arch', 'sd15')]} "
        f"({'tiny' if a['tiny'] else 'real size'}, random weights), "
        f"{a['size']}x{a['size']}, {a['steps']} steps, {a['dtype']}\n",
        f"Machine: {data['machine']['cpu_count']} CPUs"
        + (f" ({data['machine']['cpu']})" if data["machine"].get("cpu") else "")
        + f", {data['machine']['memory_gib']} GiB, torch "
        f"{data['machine']['torch']}. Each row is a fresh process; medians of {a['rounds']} interleaved rounds "
        "(few steps and rounds: the machine is small and shared). Peak RSS is ru_maxrss (touched pages of mapped "
        + ("files included; memfit rows: memfit.process_peak_rss(), the same mark with what memfit's per-stage "
           "resets of it discarded). " if _process_peaks(data) else
           "files included). **Caution: the memfit rows of this run read ru_maxrss after the run, which memfit resets "
           "at every stage, so they show the peak of each process's last stage (the decode), not its peak; later runs "
           "of this benchmark read memfit.process_peak_rss().** ")
        + f"Steady image: the median time of images 2..{a['images']} in the same process. "
        + PAGE_CACHE_NOTES[a.get("page_cache", "as-left")]
        + "Budgets: none, except where a row names one.\n",
        "| row | peak RSS (GiB) | vs diffusers | first image (s) | steady image (s) |",
        "|---|---|---|---|---|",
    ]
    base = data["summary"].get("diffusers eager", {}).get("peak_rss_bytes")
    for row in data["rows"]:
        s = data["summary"].get(row)
        if not s:
            lines.append(f"| {row} | failed | | | |")
            continue
        ratio = f"{s['peak_rss_bytes'] / base:.2f}x" if base else "-"
        lines.append(f"| {row} | {s['peak_rss_bytes'] / 2**30:.2f} | {ratio} | {s['first_image_s']:.1f} | "
                     f"{s['steady_image_s']:.1f} |")
    for theirs in ("optimum-intel static", OPTIMUM_FP16_ROW):
        anchor = data["summary"].get(theirs)
        for row in (row for row in data["rows"] if row.startswith(SESSION_ROW)):
            ours = data["summary"].get(row)
            if not (anchor and ours):
                continue
            lines += ["", f"{row} against {theirs} (targets: first image <= 0.9x, steady image <= "
                      f"1.0x, peak RSS <= 0.5x): first image {ours['first_image_s'] / anchor['first_image_s']:.2f}x, "
                      f"steady image {ours['steady_image_s'] / anchor['steady_image_s']:.2f}x, peak RSS "
                      f"{ours['peak_rss_bytes'] / anchor['peak_rss_bytes']:.2f}x."]
            paired = _paired_ratios(data["runs"], row, theirs)
            if paired:
                lines += ["", "The same ratios within each round (the two runs of a round are minutes apart, so they "
                          "share the machine's load): " + "; ".join(
                              f"round {index}: first image {first:.2f}x, steady image {steady:.2f}x"
                              for index, first, steady in paired) + "."]
    errors = [f"- {r['row']} round {r['round']}: {r['error']}" for r in data["runs"] if not r["ok"]]
    if errors:
        lines += ["", "Failed runs:", *errors]
    return "\n".join(lines) + "\n"


def _process_peaks(data: dict) -> bool:
    """Whether the memfit rows' peaks are the whole process's (runs recorded before memfit.process_peak_rss existed
    read ru_maxrss, the peak since memfit's last per-stage reset of it)."""
    return any("ru_maxrss_bytes" in r for r in data["runs"] if r["ok"])


def plot(data: dict, name: str) -> None:
    """Peak RSS against the first and the steady image, one point per row: docs/<name>.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install memfit[bench]); no plot written")
        return
    summary = {row: s for row, s in data["summary"].items() if row in data["rows"]}
    if not summary:
        return
    a = data["args"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    anchor = summary.get("optimum-intel static")
    for ax, key, label in ((axes[0], "first_image_s", "first image (s)"), (axes[1], "steady_image_s", "steady image (s)")):
        for row, s in summary.items():
            ax.scatter(s["peak_rss_bytes"] / 2**30, s[key], s=40, label=row)
        if anchor:  # the targets against optimum-intel's fastest mode: the lower left box
            target = anchor[key] * (0.9 if key == "first_image_s" else 1.0)
            ax.axvline(anchor["peak_rss_bytes"] / 2**30 * 0.5, color="grey", linestyle="--", linewidth=0.8)
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("peak RSS (GiB)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"{ARCH_NAMES[a.get('arch', 'sd15')]} {a['dtype']} {a['size']}x{a['size']}, {a['steps']} steps: medians "
                 f"of {a['rounds']} rounds (dashed: 0.5x optimum-intel static's memory, 0.9x / 1.0x its times)", fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = Path(__file__).resolve().parent.parent / "docs" / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--rerender", metavar="JSON", help="re-write the table and plot of a recorded run (no new "
                        "measurements)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--images", type=int, default=3, help="images per process (at least 2): the first is timed from "
                        "launch, the rest give the steady time per image (their median)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--arch", default="sd15", choices=tuple(ARCH_NAMES))
    parser.add_argument("--model", help="an existing pipeline folder of --arch (default: built with random fp32 weights "
                        "under --models)")
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "memfit-bench-models"))
    parser.add_argument("--out", default="openvino_memory")
    parser.add_argument("--optimum-python", help="Python of an environment with optimum-intel[openvino] installed: "
                        "adds its static- and dynamic-shape rows")
    parser.add_argument("--optimum-ir", help="the IR `optimum-cli export openvino --model MODEL --task text-to-image "
                        "DIR` wrote for the same model (needed with --optimum-python)")
    parser.add_argument("--optimum-fp16-ir", help="an IR of the same model exported with --weight-format fp16 (with "
                        "--optimum-python): adds the row '" + OPTIMUM_FP16_ROW + "', optimum-intel static on it")
    parser.add_argument("--skip", action="append", default=[], metavar="ROW", help="leave a row out (repeatable)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="memfit's compute precision (default: --dtype)")
    parser.add_argument("--session-budget", metavar="SIZE", help="adds the row '" + SESSION_BUDGET_ROW.format("SIZE")
                        + "': a Session under that budget (e.g. 4.3GiB)")
    parser.add_argument("--baseline-src", metavar="DIR", help="adds the row '" + BASELINE_ROW.format("LABEL") + "': a cold "
                        "run with memfit imported from DIR (another checkout's src/), on an empty store of its own")
    parser.add_argument("--baseline-label", default="before", help="LABEL of the --baseline-src row")
    parser.add_argument("--page-cache", choices=("as-left", "warm", "cold"), default="as-left", help="the page cache "
                        "each row starts with: warm reads the row's files first, cold drops every row's files "
                        "(default: as the row before left it)")
    parser.add_argument("--store", help="an existing memfit store to run on, kept afterwards (default: a fresh one, "
                        "filled by the cold row and removed at the end)")
    args = parser.parse_args()
    if args.images < 2:
        parser.error("--images must be at least 2: the first image includes the start, the rest are the steady time")
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.rerender:
        from common import write_outputs

        data = json.loads(Path(args.rerender).read_text())
        write_outputs(Path(args.rerender).stem, data, render(data))
        plot(data, Path(args.rerender).stem)
        return

    from common import build_real_size, machine, tiny_sd, write_outputs

    if args.tiny:
        model = tiny_sd(args.models)
        args.size = min(args.size, 64)
    else:
        model = Path(args.model) if args.model else build_real_size(args.arch, Path(args.models) / f"{args.arch}-fp32")
    runs = []
    rows = list(ROWS) + [SESSION_ROW]
    budget_row = SESSION_BUDGET_ROW.format(args.session_budget) if args.session_budget else None
    if budget_row:
        rows.append(budget_row)
    baseline_row = BASELINE_ROW.format(args.baseline_label) if args.baseline_src else None
    if baseline_row:
        rows.insert(rows.index("memfit openvino cold") + 1, baseline_row)
    if args.optimum_python:
        if not args.optimum_ir:
            parser.error("--optimum-python needs --optimum-ir, the IR optimum-cli exported for the same model")
        rows += OPTIMUM_ROWS
        if args.optimum_fp16_ir:
            rows.append(OPTIMUM_FP16_ROW)
    rows = [row for row in rows if row not in args.skip]
    if args.store and "memfit openvino cold" in rows:
        parser.error("--store runs on a filled store, so 'memfit openvino cold' would not be cold: add "
                     "--skip 'memfit openvino cold', or leave --store out")

    def save():  # after every row: a long run stopped early still leaves what it measured
        summary = {}
        for row in rows:
            ok = [r for r in runs if r["row"] == row and r["ok"]]
            if ok:
                summary[row] = {key: statistics.median(r[key] for r in ok)
                                for key in ("peak_rss_bytes", "first_image_s", "steady_image_s")}
        data = {"args": vars(args), "machine": machine(), "runs": runs, "summary": summary, "rows": rows}
        write_outputs(args.out, data, render(data))
        plot(data, args.out)

    # One store for every round: the cold row fills it in the first round only, and every later memfit row
    # starts warm, as a user's second start does.
    store = args.store or tempfile.mkdtemp(prefix="memfit-ov-store-")
    env = {**os.environ, "MEMFIT_CACHE_DIR": store}
    try:
        for round_index in range(args.rounds):
            # the cold row comes first in round 0, the only round it runs in
            for row in (rows if round_index % 2 == 0 else rows[::-1]):
                if row in ("memfit openvino cold", baseline_row) and round_index:
                    continue
                if args.page_cache == "warm":
                    set_page_cache("warm", _row_files(row, model, store, args))
                elif args.page_cache == "cold":
                    # each file once, though several memfit rows read the same model folder and store
                    set_page_cache("cold", list(dict.fromkeys(
                        file for other in rows for file in _row_files(other, model, store, args))))
                if row == OPTIMUM_FP16_ROW:
                    result = run_optimum(args.optimum_python, args.optimum_fp16_ir, True, args)
                elif row in OPTIMUM_ROWS:
                    result = run_optimum(args.optimum_python, args.optimum_ir, row.endswith("static"), args)
                else:
                    system = "diffusers" if row.startswith("diffusers") else "memfit"
                    spec = {"system": system, "model": str(model), "dtype": args.dtype, "size": args.size,
                            "steps": args.steps, "precision": args.precision, "images": args.images,
                            "session": row.startswith(SESSION_ROW),
                            "budget": args.session_budget if row == budget_row else "none"}
                    if row == baseline_row:
                        with tempfile.TemporaryDirectory(prefix="memfit-ov-baseline-store-") as baseline_store:
                            result = run_child(spec, {**env, "MEMFIT_CACHE_DIR": baseline_store,
                                                      "PYTHONPATH": str(Path(args.baseline_src).resolve())})
                    else:
                        result = run_child(spec, env)
                runs.append({"row": row, "round": round_index, **result})
                print(row, round_index, result, flush=True)
                save()
    finally:
        if not args.store:
            shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
