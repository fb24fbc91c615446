"""OpenVINO with compressed weights (memfit.compile.backends.openvino_compressed) against memfit's eager dequantizing
layers and against OpenVINO with float weights, on Flux-width linear layers.

    python benchmarks/openvino_quantized.py [--threads 2] [--rounds 5] [--tokens 256]

The model: FLUX.1-dev's MLP of a block (Linear 3072 -> 12288, GELU, Linear 12288 -> 3072; 75M weights, random,
std 0.02) with its weights stored as memfit stores them: int8 (one scale per row, as --quantize NAME=int8),
GGUF Q8_0 and Q4_0 (quantized by the gguf package). float32 compute, ``--tokens`` tokens.

* **speed**: one forward of each variant, in interleaved rounds (a shared machine: each round runs every variant
  once, so a slow spell slows them all), median per variant: eager fp32 weights, memfit's eager path
  (dequantize each layer's weight in each forward), OpenVINO fp32 weights, OpenVINO compressed (memfit's default:
  DYNAMIC_QUANTIZATION_GROUP_SIZE 0) and compressed with OpenVINO's default dynamic quantization (activations in
  int8 groups of 32).
* **error**: each variant's output against the eager dequantized output of the same stored weights (max and mean
  absolute), and the output's own scale.
* **memory**: in a fresh process per variant, the resident set after running one forward less before building
  the model (OpenVINO's CPU plugin loaded before, on a small model; the torch module dropped for the OpenVINO
  variants: what the compiled model holds), and the IR's weights file.

Writes docs/openvino_quantized.{json,md}.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTH, HIDDEN = 3072, 12288
KINDS = ("int8", "Q8_0", "Q4_0")
VARIANTS = ("eager fp32", "openvino fp32",
            *(f"eager {k}" for k in KINDS), *(f"openvino {k}" for k in KINDS), *(f"openvino {k} dq32" for k in KINDS))


def build(kind: str | None) -> torch.nn.Module:
    """The MLP with float32 weights (``kind`` None) or its weights stored as ``kind``."""
    from memfit.testing.quantized import store_weights

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(approximate="tanh"),
                                 torch.nn.Linear(HIDDEN, WIDTH)).eval().requires_grad_(False)
    for index in (0, 2):
        torch.nn.init.normal_(module[index].weight, std=0.02)
    return module if kind is None else store_weights(module, kind, ("0", "2"))


def compile_variant(variant: str, module: torch.nn.Module, inputs: torch.Tensor, threads: int):
    """The callable that runs ``variant`` over ``module``."""
    if variant.startswith("eager"):
        return lambda x: module(x)
    from memfit.compile.backends import CompileRequest, get_backend

    config = {"INFERENCE_NUM_THREADS": threads}
    if variant.endswith("dq32"):
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "32"  # OpenVINO's own default on this CPU
    return get_backend("openvino").compile(CompileRequest(lambda x: module(x), (inputs,), options={"config": config},
                                                          module=module))


def _kind(variant: str) -> str | None:
    kind = variant.split()[1]
    return None if kind == "fp32" else kind


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(variant: str, tokens: int, threads: int) -> dict:
    """Resident memory a variant holds to run (a fresh process)."""
    torch.set_num_threads(threads)
    inputs = torch.randn(tokens, WIDTH)
    # OpenVINO's CPU plugin loaded and warmed up on a small model first: its code is not the model's memory.
    small = torch.nn.Linear(WIDTH, 32).requires_grad_(False)
    compile_variant("openvino fp32", small, inputs, threads)(inputs)
    del small
    gc.collect()
    before = _rss()
    module = build(_kind(variant))
    run = compile_variant(variant, module, inputs, threads)
    if not variant.startswith("eager"):
        del module  # the compiled model holds its own weights
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with torch.no_grad():
        run(inputs)
    return {"variant": variant, "resident_bytes": _rss() - before}


def ir_bytes(kind: str | None, tokens: int) -> int:
    """The size of the IR's weights file OpenVINO saves for the MLP stored as ``kind``."""
    from memfit.compile.backends.openvino import _save_ir

    module = build(kind)
    with tempfile.TemporaryDirectory() as folder:
        xml = Path(folder) / "model.xml"
        _save_ir(lambda x: module(x), (torch.randn(tokens, WIDTH),), xml, module)
        return xml.with_suffix(".bin").stat().st_size


def measure(tokens: int, threads: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    inputs = torch.randn(tokens, WIDTH)
    modules = {kind: build(kind) for kind in (None, *KINDS)}
    with torch.no_grad():
        references = {kind: modules[kind](inputs) for kind in modules}
    runs = {}
    for variant in VARIANTS:
        started = time.perf_counter()
        runs[variant] = compile_variant(variant, modules[_kind(variant)], inputs, threads)
        print(f"{variant}: ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    times = {variant: [] for variant in VARIANTS}
    errors = {}
    with torch.no_grad():
        for variant, run in runs.items():
            reference, out = references[_kind(variant)], run(inputs)  # also the warm-up
            difference = (out - reference).abs()
            errors[variant] = {"max": difference.max().item(), "mean": difference.mean().item(),
                               "output_max": reference.abs().max().item()}
        for round_ in range(rounds):
            for variant, run in runs.items():
                started = time.perf_counter()
                run(inputs)
                times[variant].append(time.perf_counter() - started)
            print(f"round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
    rows = []
    for variant in VARIANTS:
        print(f"memory: {variant}", file=sys.stderr, flush=True)
        result = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(tokens),
                                 "--threads", str(threads)], capture_output=True, text=True, check=True)
        resident = json.loads(result.stdout.strip().splitlines()[-1])["resident_bytes"]
        rows.append({"variant": variant, "seconds": statistics.median(times[variant]),
                     "seconds_all": times[variant], **errors[variant], "resident_bytes": resident})
    stored = {kind: sum(p.numel() * p.element_size() for p in modules[kind].parameters()) for kind in modules}
    ir = {str(kind or "fp32"): ir_bytes(kind, tokens) for kind in (None, *KINDS)}
    return {"tokens": tokens, "threads": threads, "rounds": rounds, "rows": rows, "ir_weight_bytes": ir,
            "module_bytes": {str(kind or "fp32"): size for kind, size in stored.items()}}


def render(data: dict) -> str:
    from common import cpu_name

    MiB = 2**20
    base = next(row["seconds"] for row in data["rows"] if row["variant"] == "eager fp32")
    lines = [
        "# OpenVINO with compressed weights: Flux-width MLP",
        "",
        f"FLUX.1-dev's block MLP (3072 -> 12288 -> 3072, 75M weights), {data['tokens']} tokens, float32 compute, "
        f"{data['threads']} threads, {cpu_name()}, median of {data['rounds']} interleaved rounds "
        "(benchmarks/openvino_quantized.py). Error: against memfit's eager output from the same stored weights "
        "(its dequantization: Q8_0 and Q4_0 round d * q to fp16); outputs reach "
        f"{max(row['output_max'] for row in data['rows']):.2f}. Resident: the process's memory after one forward "
        "less before building the model, in a fresh process (OpenVINO's CPU plugin loaded before, on a small model; "
        "the torch module dropped for OpenVINO). dq32: OpenVINO's own default, activations quantized dynamically "
        "in int8 groups of 32 (memfit sets DYNAMIC_QUANTIZATION_GROUP_SIZE 0).",
        "",
        "| variant | s / forward | vs eager fp32 | max abs error | mean abs error | resident MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        lines.append(f"| {row['variant']} | {row['seconds']:.3f} | {row['seconds'] / base:.2f}x | {row['max']:.2e} | "
                     f"{row['mean']:.2e} | {row['resident_bytes'] / MiB:.0f} |")
    lines += ["", "Weights: " + ", ".join(
        f"{kind} {data['module_bytes'][kind] / MiB:.0f} MiB in torch, IR {data['ir_weight_bytes'][kind] / MiB:.0f} MiB"
        for kind in data["ir_weight_bytes"]) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json, measuring nothing")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.threads)))
        return
    if args.render:
        data = json.loads((args.out / "openvino_quantized.json").read_text())
    else:
        data = measure(args.tokens, args.threads, args.rounds)
        (args.out / "openvino_quantized.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "openvino_quantized.md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
