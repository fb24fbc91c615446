#!/usr/bin/env python
"""Measure memfit's demo model on captions it never saw in training.

    python scripts/eval_demo_model.py                  # all 56 held-out captions, writes docs/
    python scripts/eval_demo_model.py --n 12 --no-docs --json /tmp/eval.json

For each held-out (shape colour, shape, background) combination (memfit.demo.shapes: never in the
training set, not even as half of a two-shape image) it generates one image through plain
`diffusers.StableDiffusionPipeline.from_pretrained(model_dir)` with a fixed seed per caption, and
grades it with `memfit.demo.shapes.classify`, a classifier of pixel statistics and template
matching (no learned model):
- background colour: median of the 2-pixel border, nearest palette colour;
- shape colour: median of the foreground's interior (pixels > 80 RGB away from the background,
  largest connected component), nearest palette colour;
- shape: best IoU of that mask against a circle, square and triangle inscribed in its bounding box.
The classifier is itself checked on rendered ground-truth images of the same combinations; its
accuracy there must be ~100% for the numbers above to mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from memfit.demo import shapes  # noqa: E402

FIELDS = ("background", "colour", "shape")


def load_pipeline(model: pathlib.Path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_defaults(model: pathlib.Path) -> dict:
    path = model / "memfit_defaults.json"
    return json.loads(path.read_text()) if path.is_file() else {"steps": 25, "guidance": 4.0, "width": 64, "height": 64}


def held_out(n: int | None) -> list[shapes.Combo]:
    """The first n held-out combos in a fixed interleaved order (so a small n still mixes shapes,
    colours and backgrounds), or all of them."""
    combos = shapes.held_out_combos()
    order = sorted(range(len(combos)), key=lambda i: ((i * 37) % len(combos)))
    combos = [combos[i] for i in order]
    return combos if n is None else combos[:n]


def generate(pipe, captions: list[str], steps: int, guidance: float, size: tuple[int, int], seed: int, batch: int = 16):
    """uint8 images, one per caption; caption i always uses seed + i, whatever the batching."""
    out = []
    for start in range(0, len(captions), batch):
        chunk = captions[start : start + batch]
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        result = pipe(
            prompt=chunk,
            num_inference_steps=steps,
            guidance_scale=guidance,
            width=size[0],
            height=size[1],
            generator=generators,
            output_type="np",
        ).images
        out.extend((np.clip(result, 0, 1) * 255).round().astype(np.uint8))
    return out


def grade(images, combos) -> tuple[dict, list[dict]]:
    rows = []
    for image, (colour, shape, background) in zip(images, combos):
        pred = shapes.classify(image)
        rows.append(
            {
                "caption": shapes.combo_caption((colour, shape, background)),
                "truth": {"background": background, "colour": colour, "shape": shape},
                "pred": {"background": pred.background, "colour": pred.colour, "shape": pred.shape},
            }
        )
    accuracy = {f: sum(r["truth"][f] == r["pred"][f] for r in rows) / max(len(rows), 1) for f in FIELDS}
    accuracy["all_three"] = sum(all(r["truth"][f] == r["pred"][f] for f in FIELDS) for r in rows) / max(len(rows), 1)
    return accuracy, rows


def classifier_check(combos, per_combo: int = 3, seed: int = 1234) -> dict:
    """The classifier's accuracy on rendered ground-truth images of these combos."""
    images, combo_list = [], []
    for k, combo in enumerate(combos):
        for scene in shapes.sample_scenes(per_combo, seed + k, combos=[combo]):
            images.append(shapes.render(scene))
            combo_list.append(combo)
    accuracy, _ = grade(images, combo_list)
    accuracy["n"] = len(images)
    return accuracy


def evaluate(model: pathlib.Path, n: int | None = None, steps=None, guidance=None, seed: int = 0) -> dict:
    defaults = load_defaults(model)
    steps = steps or defaults["steps"]
    guidance = defaults["guidance"] if guidance is None else guidance
    size = (defaults.get("width", 64), defaults.get("height", 64))
    combos = held_out(n)
    pipe = load_pipeline(model)
    start = time.perf_counter()
    images = generate(pipe, [shapes.combo_caption(c) for c in combos], steps, guidance, size, seed)
    seconds = time.perf_counter() - start
    accuracy, rows = grade(images, combos)
    return {
        "n": len(combos),
        "steps": steps,
        "guidance": guidance,
        "size": list(size),
        "seed": seed,
        "accuracy": accuracy,
        "classifier_on_ground_truth": classifier_check(combos),
        "generation_seconds": round(seconds, 1),
        "rows": rows,
        "_images": images,
    }


def contact_sheet(images, captions, path: pathlib.Path, columns: int = 4, scale: int = 3) -> None:
    from PIL import Image, ImageDraw, ImageFont

    cell = images[0].shape[0] * scale
    label = 34
    rows = (len(images) + columns - 1) // columns
    sheet = Image.new("RGB", (columns * (cell + 8) + 8, rows * (cell + label + 8) + 8), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for i, (image, caption) in enumerate(zip(images, captions)):
        x = 8 + (i % columns) * (cell + 8)
        y = 8 + (i // columns) * (cell + label + 8)
        sheet.paste(Image.fromarray(image).resize((cell, cell), Image.Resampling.NEAREST), (x, y))
        words = caption.split(" on ")
        draw.text((x, y + cell + 2), words[0], fill=(0, 0, 0), font=font)
        if len(words) > 1:
            draw.text((x, y + cell + 16), "on " + words[1], fill=(0, 0, 0), font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def folder_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_docs(report: dict, docs: pathlib.Path) -> None:
    acc, gt = report["accuracy"], report["classifier_on_ground_truth"]
    training = report.get("training", {})
    secs = training.get("seconds", {})
    lines = [
        "# The built-in demo model",
        "",
        "`memfit generate --prompt \"a red circle on a blue background\"` with no `--model` runs a tiny",
        "Stable Diffusion pipeline that ships inside the package (`src/memfit/demo/model/`, standard",
        "diffusers layout, safetensors). It was trained on this repository's synthetic data set",
        "(`memfit.demo.shapes`: circles, squares and triangles in 8 colours on plain backgrounds of",
        "those colours, one or two shapes per 64x64 image) by `scripts/train_demo_model.py`, and is",
        "measured by `scripts/eval_demo_model.py`, which wrote this page.",
        "",
        "## Held-out accuracy",
        "",
        f"{report['n']} captions whose (shape colour, shape, background) combination never appears in",
        f"training; one image each, seed {report['seed']} + caption index, {report['steps']} DDIM steps,",
        f"guidance {report['guidance']}, {report['size'][0]}x{report['size'][1]}.",
        "",
        "| measure | generated images | classifier on ground truth |",
        "|---|---|---|",
    ]
    for field in ("background", "colour", "shape", "all_three"):
        name = {"background": "background colour", "colour": "shape colour", "shape": "shape", "all_three": "all three right"}[field]
        lines.append(f"| {name} | {acc[field]:.1%} | {gt[field]:.1%} |")
    bars = {"background": 0.9, "colour": 0.9, "shape": 0.6}  # issue 3's "done when"
    short = [f"{field} {acc[field]:.1%} < {bar:.0%}" for field, bar in bars.items() if acc[field] < bar]
    lines += [
        "",
        "Issue 3's bars (background and shape colour >= 90%, shape >= 60%): "
        + ("met." if not short else "NOT met: " + "; ".join(short) + ". Shapes come out blurred and "
           "rounded (squares read as circles); see the samples below."),
    ]
    lines += [
        "",
        f"The ground-truth column grades {gt['n']} rendered images of the same combinations: the",
        "classifier is only a fair judge if it is ~100% there.",
        "",
        "The classifier (pixel statistics and template matching, no learned model): background colour =",
        "median of the 2-pixel border, nearest palette colour; foreground = pixels more than 80 (RGB",
        "distance) from it, largest connected component; shape colour = median of the foreground's",
        "interior, nearest palette colour; shape = best IoU of the foreground against a circle, a square",
        "and an apex-up triangle inscribed in its bounding box.",
        "",
        "![held-out samples](demo_samples.png)",
        "",
        "## Model",
        "",
        f"- weights folder: {report['weights_mib']:.1f} MiB (fp32 safetensors)",
        f"- training: {secs.get('total', float('nan')) / 60:.1f} min on this machine (2 shared CPU cores, "
        f"one torch thread; VAE {secs.get('vae', float('nan')) / 60:.1f} min, text encoder + UNet "
        f"{secs.get('diffusion', float('nan')) / 60:.1f} min), seed {training.get('seed')}",
    ]
    fine = training.get("fine_tune")
    if fine:
        base_secs = training.get("fine_tuned_from", {}).get("seconds", {})
        lines += [
            f"  (a {base_secs.get('total', float('nan')) / 60:.1f} min from-scratch run, then "
            f"`--resume-from` fine-tuning of the UNet + text encoder for {fine['config']['steps']} more "
            f"steps with the VAE frozen, {fine['seconds']['total'] / 60:.1f} min)",
        ]
    lines += [
        "- AutoencoderKL 64x64x3 <-> 16x16x4; CLIPTextModel (3 layers, width 64) trained from scratch with",
        "  the UNet2DConditionModel (48/96/96 channels); v-prediction on a zero-terminal-SNR schedule;",
        "  DDIMScheduler with trailing timesteps; tokenizer over the 15-word caption vocabulary.",
        f"- generation defaults (memfit_defaults.json): `{json.dumps(report['defaults'])}`",
        "",
        (
            "Retrain with `python scripts/train_demo_model.py --out /tmp/demo_base` then `python "
            f"scripts/train_demo_model.py --resume-from /tmp/demo_base --steps {fine['config']['steps']}`"
            " (default --out: the shipped folder)"
            if fine
            else "Retrain with `python scripts/train_demo_model.py`"
        )
        + "; re-measure with `python scripts/eval_demo_model.py`.",
        "",
    ]
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "demo_model.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, default=None, help="default: the shipped demo model")
    parser.add_argument("--n", type=int, default=None, help="how many held-out captions (default: all 56)")
    parser.add_argument("--steps", type=int, default=None, help="default: memfit_defaults.json")
    parser.add_argument("--guidance", type=float, default=None, help="default: memfit_defaults.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the full report here")
    parser.add_argument("--docs", type=pathlib.Path, default=ROOT / "docs", help="where demo_model.md/.json/_samples.png go")
    parser.add_argument("--no-docs", action="store_true", help="write nothing under docs/")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from memfit.demo import model_dir

        args.model = model_dir()

    report = evaluate(args.model, args.n, args.steps, args.guidance, args.seed)
    images = report.pop("_images")
    report["weights_mib"] = round(folder_size(args.model) / 2**20, 2)
    report["defaults"] = load_defaults(args.model)
    training_path = args.model / "training.json"
    if training_path.is_file():
        report["training"] = json.loads(training_path.read_text())

    print(f"{'caption':<46} {'background':<10} {'colour':<8} {'shape':<9}")
    for row in report["rows"]:
        marks = [
            (row["pred"][f] or "-") + ("" if row["pred"][f] == row["truth"][f] else " x") for f in FIELDS
        ]
        print(f"{row['caption']:<46} {marks[0]:<10} {marks[1]:<8} {marks[2]:<9}")
    acc, gt = report["accuracy"], report["classifier_on_ground_truth"]
    print()
    print(f"held-out accuracy, n={report['n']} ({report['steps']} steps, guidance {report['guidance']}):")
    for field in ("background", "colour", "shape", "all_three"):
        print(f"  {field:<11} {acc[field]:6.1%}   (classifier on {gt['n']} ground-truth images: {gt[field]:.1%})")
    print(f"generation {report['generation_seconds']}s, weights {report['weights_mib']} MiB")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_docs:
        summary = {k: v for k, v in report.items() if k != "rows"}
        (args.docs).mkdir(parents=True, exist_ok=True)
        (args.docs / "demo_model.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_docs(report, args.docs)
        pick = list(range(min(12, len(images))))
        contact_sheet([images[i] for i in pick], [report["rows"][i]["caption"] for i in pick], args.docs / "demo_samples.png")
        print(f"wrote {args.docs / 'demo_model.md'}, demo_model.json, demo_samples.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
