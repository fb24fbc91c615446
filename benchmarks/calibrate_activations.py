"""Calibrate memfit's activation estimates (memfit.plan.meta.ACTIVATION_FACTORS) on real-size models.

    python benchmarks/calibrate_activations.py            # sd15 fp32 and sdxl bf16, random weights

For each case, a fresh process loads one component, runs it once at a tiny size (so every weight
page is resident and the kernels are initialized), resets the kernel's RSS high-water mark, runs
one forward at the measured size and reads the high-water mark again: the difference is the
activation peak (every tensor and workspace the forward held at once). The shape model of
memfit.plan.meta.activation_estimate gives the element count the factor multiplies; factor =
measured bytes / (elements * dtype bytes). Writes docs/activation_calibration.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = [
    # arch, dtype, kind, strategy, size, batch
    ("sd15", "fp32", "text_encoder", "plain", 512, 2),
    ("sd15", "fp32", "unet", "plain", 512, 2),
    ("sd15", "fp32", "unet", "plain", 512, 1),
    ("sd15", "fp32", "unet", "plain", 256, 2),
    ("sd15", "fp32", "unet", "chunked", 512, 2),
    ("sd15", "fp32", "unet", "chunked", 512, 1),
    ("sd15", "fp32", "unet", "chunked", 256, 1),
    ("sd15", "fp32", "vae_decoder", "plain", 512, 1),
    ("sd15", "fp32", "vae_decoder", "plain", 256, 1),
    ("sd15", "fp32", "vae_decoder", "banded", 512, 1),
    ("sd15", "fp32", "vae_decoder", "banded", 256, 1),
    ("sdxl", "bf16", "text_encoder", "plain", 512, 2),
    ("sdxl", "bf16", "unet", "plain", 512, 2),
    ("sdxl", "bf16", "unet", "plain", 512, 1),
    ("sdxl", "bf16", "vae_decoder", "plain", 512, 1),
    ("sdxl", "bf16", "vae_decoder", "banded", 512, 1),
]
ESTIMATE_KINDS = {("vae_decoder", "banded"): "vae_decoder_banded", ("unet", "chunked"): "unet_chunked"}
FOLDERS = {"sd15": "/tmp/bm/sd15-fp32", "sdxl": "/tmp/bm/sdxl-bf16"}
FILE_DTYPES = {"sd15": "fp32", "sdxl": "bf16"}


def measure(arch: str, dtype_name: str, kind: str, strategy: str, size: int, batch: int) -> dict:
    """In the child process: one component, one forward; returns the activation peak in bytes."""
    import gc

    import torch

    from memfit.run.memory import read_peak_rss, reset_peak_rss, current_rss, release_freed_memory, return_large_frees_to_os
    from memfit.dtypes import parse_dtype

    return_large_frees_to_os()
    dtype = parse_dtype(dtype_name)
    folder = Path(FOLDERS[arch])
    import diffusers
    import transformers

    if kind == "unet":
        model = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet", torch_dtype=dtype)
        cross = model.config.cross_attention_dim
        if model.config.addition_embed_type == "text_time":
            def extra_for(b):
                return {"added_cond_kwargs": {"text_embeds": torch.zeros(b, 1280, dtype=dtype), "time_ids": torch.zeros(b, 6, dtype=dtype)}}
        else:
            def extra_for(b):
                return {}

        def run(px, b):
            latent = torch.zeros(b, 4, px // 8, px // 8, dtype=dtype)
            return model(latent, torch.tensor(10), torch.zeros(b, 77, cross, dtype=dtype), **extra_for(b)).sample
        config = dict(model.config)
        if strategy == "chunked":
            from memfit.run.chunked_attention import enable_chunked_attention

            enable_chunked_attention(model)
    elif kind == "vae_decoder":
        model = diffusers.AutoencoderKL.from_pretrained(folder / "vae", torch_dtype=dtype)
        if strategy == "banded":
            from memfit.run.banded_decode import enable_banded_decode

            enable_banded_decode(model)

        def run(px, b):
            return model.decode(torch.zeros(b, 4, px // 8, px // 8, dtype=dtype)).sample
        config = dict(model.config)
    else:
        name = "text_encoder_2" if arch == "sdxl" else "text_encoder"
        cls = transformers.CLIPTextModelWithProjection if arch == "sdxl" else transformers.CLIPTextModel
        model = cls.from_pretrained(folder / name, dtype=dtype)

        def run(px, b):
            return model(torch.zeros(b, 77, dtype=torch.long))[0]
        config = model.config.to_dict()
    model.eval()
    with torch.inference_mode():
        run(64, 1)  # every weight page resident, kernels initialized
        gc.collect()
        release_freed_memory()
        if not reset_peak_rss():
            raise SystemExit("needs /proc/self/clear_refs (Linux)")
        base = current_rss()
        out = run(size, batch)
        peak = read_peak_rss()
    del out
    return {"activation_bytes": peak - base, "base_rss": base, "config": config}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--arch", action="append", help="only these archs (sd15, sdxl)")
    parser.add_argument("--rerender", action="store_true", help="rewrite the markdown from the recorded JSON")
    parser.add_argument("--only", action="append", metavar="KIND",
                        help="measure only these estimate kinds (e.g. unet_chunked) and replace their rows in the "
                             "recorded JSON, keeping the others")
    args = parser.parse_args()
    if args.rerender:
        path = Path(__file__).resolve().parent.parent / "docs" / "activation_calibration.json"
        path.with_suffix(".md").write_text(render(json.loads(path.read_text())["rows"]))
        return
    if args.child:
        case = json.loads(args.child)
        print(json.dumps(measure(*case), default=str))
        return

    from common import build_real_size, machine, write_outputs

    from memfit.plan.meta import ACTIVATION_FACTORS, ACTIVATION_OFFSETS, activation_elements, activation_estimate, dtype_bytes
    from memfit.dtypes import parse_dtype

    rows = []
    for case in CASES:
        arch, dtype_name, kind, strategy, size, batch = case
        estimate_kind = ESTIMATE_KINDS.get((kind, strategy), kind)
        if (args.arch and arch not in args.arch) or (args.only and estimate_kind not in args.only):
            continue
        file_dtype = parse_dtype(FILE_DTYPES[arch])
        build_real_size(arch, FOLDERS[arch], file_dtype=file_dtype)
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        unit = batch * dtype_bytes(dtype_name) * activation_elements(
            estimate_kind, result["config"], width=size, height=size, text_tokens=77)
        estimate = activation_estimate(estimate_kind, result["config"], width=size, height=size, batch=batch,
                                       dtype=dtype_name, text_tokens=77)
        row = {"arch": arch, "dtype": dtype_name, "kind": estimate_kind, "size": size, "batch": batch,
               "measured_bytes": result["activation_bytes"], "shape_model_bytes": unit,
               "factor": result["activation_bytes"] / unit, "memfit_estimate_bytes": estimate}
        rows.append(row)
        print(f"{arch} {dtype_name} {estimate_kind} {size}px batch {batch}: {row['measured_bytes'] / 2**20:.0f} MiB "
              f"(memfit estimates {estimate / 2**20:.0f} MiB), factor alone {row['factor']:.2f}", flush=True)
    if args.only:  # the other kinds as recorded
        recorded = json.loads((Path(__file__).resolve().parent.parent / "docs" / "activation_calibration.json").read_text())
        measured = {(row["arch"], row["kind"]) for row in rows}
        rows = [row for row in recorded["rows"] if (row["arch"], row["kind"]) not in measured] + rows
    fits = fit(rows)
    for kind, (factor, offset) in fits.items():
        print(f"fit {kind}: factor {factor:.2f}, offset {offset / 2**20:.0f} MiB "
              f"(memfit uses {ACTIVATION_FACTORS[kind]:.2f}, {ACTIVATION_OFFSETS[kind] / 2**20:.0f} MiB)")

    write_outputs("activation_calibration", {"machine": machine(), "rows": rows, "fits": fit(rows)}, render(rows))


def render(rows: list[dict]) -> str:
    """The markdown page; memfit's estimates are recomputed from the current ACTIVATION_FACTORS."""
    from memfit.plan.meta import ACTIVATION_FACTORS, ACTIVATION_OFFSETS

    lines = [
        "# Activation calibration",
        "",
        "Measured by `benchmarks/calibrate_activations.py`: one forward of one real-size component (random weights) "
        "in a fresh process, peak RSS (VmHWM) minus RSS before the forward, after a tiny warm-up forward at 64 px "
        "(so weights and kernels are already resident), with the allocator setting memfit uses under a budget "
        "(`memfit.run.memory.return_large_frees_to_os`: glibc's mmap threshold at 1 MiB; the banded decode raises it "
        "to its 16 MiB band size while it runs). Shape model: `memfit.plan.meta.activation_elements`. memfit's "
        "`ACTIVATION_FACTORS` / `ACTIVATION_OFFSETS` are the least-squares fit below; 'memfit estimate' is what they "
        "give for each measured case now.",
        "",
        "| arch | dtype | kind | size | batch | measured MiB | memfit estimate MiB | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        estimate = ACTIVATION_FACTORS[r["kind"]] * r["shape_model_bytes"] + ACTIVATION_OFFSETS[r["kind"]]
        error = (estimate - r["measured_bytes"]) / r["measured_bytes"]
        lines.append(f"| {r['arch']} | {r['dtype']} | {r['kind']} | {r['size']} | {r['batch']} | "
                     f"{r['measured_bytes'] / 2**20:.0f} | {estimate / 2**20:.0f} | {error:+.0%} |")
    lines += ["", "Least-squares fit per kind (estimate = factor x elements x batch x dtype bytes + offset):", "",
              "| kind | factor | offset MiB |", "|---|---|---|"]
    lines += [f"| {kind} | {factor:.2f} | {offset / 2**20:.0f} |" for kind, (factor, offset) in fit(rows).items()]
    return "\n".join(lines) + "\n"


def fit(rows: list[dict]) -> dict[str, tuple[float, int]]:
    """Per kind, factor and offset minimizing the squared error; one point: the factor alone."""
    fits = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        points = [(r["shape_model_bytes"], r["measured_bytes"]) for r in rows if r["kind"] == kind]
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        factor = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
        offset = mean_y - factor * mean_x
        if factor <= 0 or offset < 0:
            factor, offset = max(y / x for x, y in points), 0.0
        fits[kind] = (factor, int(offset))
    return fits


if __name__ == "__main__":
    main()
