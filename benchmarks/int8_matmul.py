"""int8 weight-only layers on the CPU: dequantize then matmul (what QuantizedLinear does) against torch's int8
weight-only matmul (``torch.ops.aten._weight_int8pack_mm``), for Flux-width linear layers.

    python benchmarks/int8_matmul.py [--threads 2] [--repeats 5]

Each layer's weight is random (std 0.02), quantized as ``--quantize NAME=int8`` quantizes it (one scale per
output row); the inputs random (std 1). For each compute dtype, layer shape and token count it times both paths
(median of ``repeats``, after one warm-up), and a plain matmul with the weight already dequantized (what a
layer kept dequantized costs). Error: each path's output against the exact product (float64) of the same
inputs and the dequantized weight in the compute dtype, i.e. what the dequantized path computes before its
rounding; the dequantized path's own error is the rounding level. Writes docs/int8_matmul.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_name

from memfit.quant.formats import INT8_FORMAT, StoredTensor
from memfit.quant.writers import quantize_int8_rows

SHAPES = ((3072, 3072), (12288, 3072))  # (out, in): Flux's attention projections and its MLP's first layer
TOKENS = (16, 256, 1024)
DTYPES = (torch.bfloat16, torch.float32)


def _median_seconds(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(repeats: int) -> list[dict]:
    rows = []
    for out_features, in_features in SHAPES:
        torch.manual_seed(0)
        weight, scale = quantize_int8_rows(torch.randn(out_features, in_features) * 0.02)
        stored = StoredTensor(INT8_FORMAT, (out_features, in_features), scale)
        for dtype in DTYPES:
            dequantized = stored.dequantize(weight, dtype)
            for tokens in TOKENS:
                inputs = torch.randn(tokens, in_features).to(dtype)
                def dequantizing(inputs=inputs, stored=stored, weight=weight, dtype=dtype):
                    return F.linear(inputs, stored.dequantize(weight, dtype))

                def int8(inputs=inputs, weight=weight, scale=scale, dtype=dtype):
                    return torch.ops.aten._weight_int8pack_mm(inputs, weight, scale.to(dtype))

                exact = inputs.double() @ dequantized.double().T
                row = {"out": out_features, "in": in_features, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                       "dequantize_s": _median_seconds(dequantizing, repeats),
                       "int8_mm_s": _median_seconds(int8, repeats),
                       "kept_dequantized_s": _median_seconds(
                           lambda inputs=inputs, dequantized=dequantized: F.linear(inputs, dequantized), repeats),
                       "dequantize_max_abs_error": (dequantizing().double() - exact).abs().max().item(),
                       "int8_mm_max_abs_error": (int8().double() - exact).abs().max().item(),
                       "int8_mm_vs_dequantize_max_abs": (int8().double() - dequantizing().double()).abs().max().item(),
                       "output_mean_abs": exact.abs().mean().item()}
                rows.append(row)
                print(row, flush=True)
    return rows


def render(data: dict) -> str:
    lines = ["# int8 weight-only matmul on the CPU", "",
             (f"`benchmarks/int8_matmul.py`: {data['machine']}, torch {data['torch']}, {data['threads']} threads, "
              f"median of {data['repeats']}. Seconds per layer forward; errors are max abs against the exact product "
              "of the inputs and the dequantized weight in the compute dtype (what the dequantize path computes "
              "before rounding its output)."), "",
             ("| layer (out x in) | dtype | tokens | dequantize + matmul | int8 matmul | kept dequantized | "
              "error: dequantize | error: int8 matmul | mean abs output |"), "|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['out']}x{row['in']} | {row['dtype']} | {row['tokens']} | {row['dequantize_s'] * 1e3:.1f} ms"
                     f" | {row['int8_mm_s'] * 1e3:.1f} ms | {row['kept_dequantized_s'] * 1e3:.1f} ms | "
                     f"{row['dequantize_max_abs_error']:.3g} | {row['int8_mm_max_abs_error']:.3g} | "
                     f"{row['output_mean_abs']:.3g} |")
    lines += ["", data["decision"], ""]
    if data.get("load_before"):
        lines += [(f"The machine's load average before the run: {data['load_before']} (a shared machine: single "
                   "rows can be off by tens of percent; the decision rests on the differences that are several "
                   "times that)."), ""]
    return "\n".join(lines)


def decide(rows: list[dict]) -> str:
    """The sentence the docs give: where the int8 matmul is faster, where its error is at the rounding level
    (within twice the dequantize path's), and whether QuantizedLinear uses it (only if both, everywhere)."""
    faster = [row for row in rows if row["int8_mm_s"] < row["dequantize_s"]]
    exact_enough = [row for row in rows if row["int8_mm_max_abs_error"] <= 2 * row["dequantize_max_abs_error"]]
    both = [row for row in faster if row in exact_enough]
    verdict = "so memfit uses it" if len(both) == len(rows) else "so memfit keeps it off (memfit.quant.layers.INT8_MATMUL)"
    where_faster = ", ".join(sorted({f"{row['dtype']} at {row['tokens']} tokens" for row in faster})) or "nowhere"
    return (f"The int8 matmul is faster than dequantize + matmul in {len(faster)} of {len(rows)} cases ({where_faster}) "
            f"and within twice the dequantize path's rounding error in {len(exact_enough)} of {len(rows)}: it takes "
            "its scales in the activations' dtype (bf16 scales add a rounding the dequantize path, which multiplies "
            "in float32, does not have) and accumulates in its own order; "
            f"{verdict}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json, measuring nothing")
    args = parser.parse_args()
    if args.render:
        data = json.loads((args.out / "int8_matmul.json").read_text())
        data["decision"] = decide(data["rows"])
        (args.out / "int8_matmul.json").write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "int8_matmul.md").write_text(render(data))
        return
    torch.set_num_threads(args.threads)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else None
    rows = measure(args.repeats)
    data = {"machine": f"{cpu_name()} ({os.cpu_count()} CPUs)", "torch": torch.__version__, "threads": args.threads,
            "repeats": args.repeats, "load_before": load, "rows": rows, "decision": decide(rows)}
    (args.out / "int8_matmul.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "int8_matmul.md").write_text(render(data))
    print(data["decision"])


if __name__ == "__main__":
    main()
