"""The GPU check of memfit's streaming path, for one call on a machine with one GPU (benchmarks/gpu_check.sh
runs it; about 2.5 minutes on an H200, its models built there).

    bash benchmarks/gpu_check.sh                         # a CUDA machine: docs/gpu_check.{json,md}
    bash benchmarks/gpu_check.sh --fake --out-dir /tmp/x # no GPU: the same code on memfit's fake CUDA runtime

What it measures, each part in its own try (one failure is a row with its error, not a lost run) and
within a deadline (``--deadline``: parts that would start after it are skipped, saying so):

  bandwidth    host-to-device copies from pinned (memfit's arena) and from pageable memory.
  correctness  a tiny SD pipeline, every tier mix (host, disk, host + disk) with prefetch on and off,
               and with the side stream's copies deliberately slowed (each copy waits ~1 ms on the GPU
               first, so a missing wait reads a block before it arrived), against the same pipeline all
               resident on the device: bitwise.
  sweep        a Flux-width transformer (``--double`` double and ``--single`` single blocks, FLUX.1's widths,
               random bf16 weights, saved to a folder for the disk tier) at ``--size``: memfit with 100, 50,
               25 and 0% of its weights resident, 25% without prefetch, 25% from disk; diffusers' group
               offloading (block_level, one block per group, and leaf_level; use_stream=True), which keeps
               every weight off the device, beside memfit's 0% row. Per row: seconds per forward (median
               after a warm-up), peak allocated and reserved device memory, pinned host bytes, bytes
               streamed per forward, the copy-bound estimate (those bytes / pinned bandwidth), the
               compute-bound one (the all-resident forward) and the ratio to the larger. The all-resident
               row also gives the activation peak measured against memfit's estimate (the GPU margin).
  quantized    the sweep's transformer as GGUF Q8_0 and Q4_0: memfit resident, streamed from pinned memory and
               from the file, and planned from a device budget, against diffusers' GGUF loading resident and
               with group offloading; outputs compared (benchmarks/gpu_quantized.py).
  profile      one forward at 25% resident under torch.profiler: the kernels and copies that took most
               device time, the copy total, and a trace (profile_trace.json.gz).
  sanitizer    TORCH_CUDA_SANITIZER=1 (torch's stream-race checker) over the tiny pipeline's streamed
               denoiser, in a child process (the variable must be set before CUDA starts).

``--fake`` runs everything on memfit's fake CUDA runtime (lazy: a copy completes only when waited for,
the strictest order there is, so copies are not slowed further) with tiny sizes; diffusers' group
offloading and the sanitizer need CUDA and are skipped. Its figures mean nothing: it shows the script
works (tests/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

GiB = 2**30
#: GPU clock cycles a slowed copy waits before it starts (about 1 ms at 1.5-2 GHz).
SLOW_COPY_CYCLES = 2_000_000
#: FLUX.1's widths; the block counts come from --double and --single.
FLUX_WIDTHS = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
                   joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
TINY_FLUX = dict(patch_size=1, in_channels=16, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8))
SD_TIERS = {  # the tiny SD's tier mixes, every component streamed somewhere
    "host": {"text_encoder/*": "host", "unet/*": "host", "vae/*": "host"},
    "disk": {"text_encoder/*": "disk", "unet/*": "disk", "vae/*": "disk"},
    "host+disk": {"text_encoder/*": "disk", "unet/down_blocks.*": "disk", "unet/mid_block.*": "host",
                  "unet/up_blocks.*": "host", "vae/decoder.*": "disk", "vae/rest": "host"},
}


class Check:
    """The run's results and its deadline; written to ``out_dir`` after every part, so a run stopped by its
    time limit still leaves what it measured."""

    def __init__(self, deadline: float, out_dir: Path, only: set[str] = frozenset()):
        self.only = only
        self.started = time.perf_counter()
        self.deadline = deadline
        self.out_dir = out_dir
        self.data: dict = {"parts": {}}

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.started)

    def part(self, name: str, run, *, needs: float = 0.0):
        """Run ``run()`` as part ``name``; its result, its error, or why it was skipped goes into the data."""
        if self.only and name not in self.only:
            return None
        if self.left() < needs:
            self.data["parts"][name] = {"skipped": f"{self.left():.0f} s left of the deadline, {needs:.0f} s needed"}
            print(f"[gpu_check] {name}: skipped (deadline)", flush=True)
            return None
        started = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            result = run()
        except Exception as exc:  # one part's failure must not hide the others'
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      "traceback": traceback.format_exc(limit=-6)}
        seconds = time.perf_counter() - started
        self.data["parts"][name] = {"seconds": round(seconds, 2), **(result if isinstance(result, dict) else
                                                                    {"rows": result})}
        print(f"[gpu_check] {name}: {seconds:.1f} s", flush=True)
        self.save()
        return result

    def save(self) -> None:
        self.data["wall_seconds"] = time.perf_counter() - self.started
        (self.out_dir / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (self.out_dir / "gpu_check.md").write_text(markdown(self.data))


# --- bandwidth ----------------------------------------------------------------------------------------------


def bandwidth(runtime, nbytes: int) -> dict:
    import torch

    from gpu_streaming import pinned_bandwidth

    pinned = pinned_bandwidth(runtime, nbytes)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    runtime.to_device(pageable)
    runtime.synchronize()
    started = time.perf_counter()
    copies = [runtime.to_device(pageable) for _ in range(3)]
    runtime.synchronize()
    seconds = time.perf_counter() - started
    del copies
    return {"bytes": nbytes, "pinned_bytes_per_s": pinned, "pageable_bytes_per_s": 3 * nbytes / seconds}


# --- correctness -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def slowed_copies(runtime, slow: bool):
    """Every copy queued on a side stream first waits ~1 ms on the GPU (``torch.cuda._sleep``): a block read
    before the wait for it is then still arriving, and the image shows it."""
    import torch

    if not slow or runtime.device.type != "cuda":
        yield
        return
    copy = runtime.to_device

    def slowed(host, dtype=None):
        if torch.cuda.current_stream(runtime.device) != torch.cuda.default_stream(runtime.device):
            torch.cuda._sleep(SLOW_COPY_CYCLES)
        return copy(host, dtype)

    runtime.to_device = slowed
    try:
        yield
    finally:
        del runtime.to_device  # the class's method again


def generate(pipe, device):
    import torch

    return pipe(prompt="a lighthouse at dusk", negative_prompt="fog", num_inference_steps=2, guidance_scale=4.0,
                width=32, height=32, generator=torch.Generator("cpu").manual_seed(0), output_type="np").images


def load_pipeline(folder):
    import diffusers
    import torch

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def correctness(runtime, folder: Path, slow_options, passes: int) -> list[dict]:
    import numpy as np

    import memfit

    pipe = load_pipeline(folder)
    pipe.to(runtime.device)
    reference = generate(pipe, runtime.device)
    pipe.to("cpu")
    rows = []
    for mix, tiers in SD_TIERS.items():
        for prefetch in (True, False):
            for slow in slow_options:
                row = {"tiers": mix, "prefetch": prefetch, "slowed_copies": slow}
                try:
                    memfit.optimize(pipe, force_tiers=tiers, device=runtime, prefetch=prefetch)
                    try:
                        with slowed_copies(runtime, slow):
                            # every pass after a block's first run prefetches: the second step, a second image
                            images = [generate(pipe, runtime.device) for _ in range(passes)]
                    finally:
                        memfit.restore(pipe)
                    difference = max(int(np.abs(image.astype(np.float64) - reference).max() * 255) for image in images)
                    row.update(bitwise=all(np.array_equal(image, reference) for image in images),
                               max_difference_8bit=difference, error=None)
                except Exception as exc:
                    row.update(bitwise=False, max_difference_8bit=None, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


# --- the sweep ---------------------------------------------------------------------------------------------------


def build_transformer(folder: Path, config: dict, build_device, dtype) -> None:
    """Random weights (diffusers' own initialisation, on ``build_device``: fast on a GPU), saved to ``folder``."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(build_device):
        model = FluxTransformer2DModel(**config)
    model.to(device="cpu", dtype=dtype).save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()


def load_transformer(folder: Path, dtype):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(folder, torch_dtype=dtype).eval()


def sweep(runtime, folder: Path, *, size: int, text_tokens: int, steps: int, dtype, bandwidth_per_s: float,
          group_offload: bool, check: Check) -> dict:
    import torch

    import memfit
    from gpu_streaming import Holder, flux_inputs, host_pinned_bytes, record_row, streamed_blocks, time_steps
    from memfit.plan.meta import activation_estimate

    transformer = load_transformer(folder, dtype)
    inputs = flux_inputs(transformer, size, text_tokens, runtime.device)
    runs = [("memfit 100% resident", 1.0, "host", True), ("memfit 50% resident", 0.5, "host", True),
            ("memfit 25% resident", 0.25, "host", True), ("memfit 0% resident", 0.0, "host", True),
            ("memfit 25% resident, no prefetch", 0.25, "host", False),
            ("memfit 25% resident, from disk", 0.25, "disk", True)]
    rows, compute = [], None
    for label, resident, where, prefetch in runs:
        if check.left() < 20:
            rows.append({"run": label, "skipped": "deadline"})
            continue
        holder = Holder("transformer", transformer)
        tiers, streamed, total = streamed_blocks(transformer, resident, where)
        row = {"run": label, "resident_fraction": resident, "weights_bytes": total,
               "streamed_bytes_per_forward": streamed}
        try:
            memfit.optimize(holder, force_tiers=tiers, device=runtime, prefetch=prefetch, model_dir=folder)
            try:
                seconds, memory = time_steps(transformer, inputs, runtime, steps)
                row.update(pinned_bytes=runtime.pinned_bytes(), **memory)
            finally:
                memfit.restore(holder)
            row.update(seconds_per_forward=statistics.median(seconds), step_seconds=seconds)
            if resident == 1.0:
                compute = row["seconds_per_forward"]
                estimate = activation_estimate("transformer", dict(transformer.config), width=size, height=size,
                                               batch=1, text_tokens=text_tokens, dtype="bf16" if dtype == torch.bfloat16
                                               else "fp32")
                measured = row["max_allocated_bytes"] - total
                row.update(activation_measured_bytes=measured, activation_estimate_bytes=estimate,
                           activation_margin=measured / estimate if estimate else None)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        record_row(rows, row, runtime)
    del transformer
    gc.collect()
    if group_offload:
        for offload_type, options in (("block_level", dict(num_blocks_per_group=1)), ("leaf_level", {})):
            if check.left() < 40:
                rows.append({"run": f"diffusers group offload ({offload_type})", "skipped": "deadline"})
                continue
            row = {"run": f"diffusers group offload ({offload_type}, use_stream)", "resident_fraction": 0.0}
            try:
                model = load_transformer(folder, dtype)
                total = sum(p.numel() * p.element_size() for p in model.parameters())
                before = host_pinned_bytes() or 0
                model.enable_group_offload(runtime.device, offload_type=offload_type, use_stream=True, **options)
                seconds, memory = time_steps(model, inputs, runtime, steps)
                after = host_pinned_bytes()
                row.update(weights_bytes=total, streamed_bytes_per_forward=total,
                           seconds_per_forward=statistics.median(seconds), step_seconds=seconds,
                           pinned_bytes=None if after is None else after - before, **memory)
                del model
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            gc.collect()
            record_row(rows, row, runtime)
    for row in rows:
        if "seconds_per_forward" in row and compute:
            copy_bound = row["streamed_bytes_per_forward"] / bandwidth_per_s
            row.update(copy_bound_seconds=copy_bound, compute_bound_seconds=compute,
                       ratio_to_bound=row["seconds_per_forward"] / max(compute, copy_bound))
    return {"rows": rows, "size": size, "text_tokens": text_tokens, "forwards_timed": steps}


# --- profile ---------------------------------------------------------------------------------------------------


def profile(runtime, folder: Path, out_dir: Path, *, size: int, text_tokens: int, dtype) -> dict:
    import torch
    from torch.profiler import ProfilerActivity

    import memfit
    from gpu_streaming import Holder, flux_inputs, streamed_blocks

    transformer = load_transformer(folder, dtype)
    holder = Holder("transformer", transformer)
    tiers, streamed, _ = streamed_blocks(transformer, 0.25)
    inputs = flux_inputs(transformer, size, text_tokens, runtime.device)
    on_gpu = runtime.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    memfit.optimize(holder, force_tiers=tiers, device=runtime)
    try:
        with torch.no_grad():
            transformer(**inputs)  # learns the order: the profiled forward prefetches
            runtime.synchronize()
            with torch.profiler.profile(activities=activities) as profiler:
                transformer(**inputs)
                runtime.synchronize()
    finally:
        memfit.restore(holder)
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"

    def self_time(event) -> float:  # older torch names the device column after CUDA
        return getattr(event, key, None) or getattr(event, "self_cuda_time_total", 0) if on_gpu else getattr(event, key)

    events = sorted(profiler.key_averages(), key=self_time, reverse=True)
    top = [{"name": e.key, "calls": e.count, "self_us": round(self_time(e), 1)} for e in events[:12]]
    copies = sum(self_time(e) for e in events if "Memcpy HtoD" in e.key or e.key == "aten::copy_")
    trace = out_dir / "profile_trace.json"
    profiler.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(str(trace) + ".gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    return {"resident_fraction": 0.25, "streamed_bytes": streamed, "time_column": key, "top": top,
            "copy_us": round(copies, 1), "trace": trace.name + ".gz"}


# --- sanitizer -----------------------------------------------------------------------------------------------------


def sanitizer(folder: Path, timeout: float) -> dict:
    """This script again, with TORCH_CUDA_SANITIZER=1, over one streamed run (``--sanitizer-run``)."""
    environment = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    done = subprocess.run([sys.executable, __file__, "--sanitizer-run", str(folder)], env=environment,
                          capture_output=True, text=True, timeout=timeout)
    output = (done.stdout + done.stderr).strip().splitlines()
    return {"passed": done.returncode == 0, "returncode": done.returncode, "output_tail": output[-15:]}


def sanitizer_run(folder: Path) -> int:
    """The tiny SD's denoiser streamed from host and disk with prefetch, two forwards, against it all resident."""
    import torch

    import memfit
    from memfit.devices import runtime_for

    runtime = runtime_for("cuda")
    pipe = load_pipeline(folder)
    unet = pipe.unet.to(runtime.device)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 4, 4, generator=generator).to(runtime.device)
    context = torch.randn(1, 7, unet.config.cross_attention_dim, generator=generator).to(runtime.device)
    with torch.inference_mode():
        reference = unet(sample, torch.tensor([10], device=runtime.device), context).sample
        unet.to("cpu")
        memfit.optimize(pipe, force_tiers=SD_TIERS["host+disk"], device=runtime)
        outputs = [pipe.unet(sample, torch.tensor([10], device=runtime.device), context).sample for _ in range(2)]
        memfit.restore(pipe)
    torch.cuda.synchronize()
    same = all(torch.equal(output, reference) for output in outputs)
    print(f"sanitized streamed run: bitwise {same}")
    return 0 if same else 1


# --- output ----------------------------------------------------------------------------------------------------------


def _size(value) -> str:
    from memfit.sizes import format_bytes

    return "-" if value is None else format_bytes(value)


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def budget_note(row: dict) -> str:
    return f"device budget {_size(row['device_budget'])}" if row.get("device_budget") else ""


def markdown(data: dict) -> str:
    parts = data["parts"]
    lines = [f"# GPU check ({data['device']})", "", f"torch {data['torch']}, {data['wall_seconds']:.0f} s in all; "
             "see benchmarks/gpu_check.py for what each part does.", ""]
    lines += [f"- run {run}" for run in data.get("runs", [])] + ([""] if data.get("runs") else [])
    for name, part in parts.items():
        if "skipped" in part or "error" in part:
            lines += [f"**{name}**: {part.get('skipped') or part.get('error')}", ""]
    found = parts.get("bandwidth", {})
    if "pinned_bytes_per_s" in found:
        lines += [f"Host to device: pinned {found['pinned_bytes_per_s'] / 1e9:.2f} GB/s, pageable "
                  f"{found['pageable_bytes_per_s'] / 1e9:.2f} GB/s ({_size(found['bytes'])} copies).", ""]
    rows = parts.get("correctness", {}).get("rows")
    if rows:
        lines += ["| tiers | prefetch | slowed copies | bitwise | max difference (8-bit) | error |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['tiers']} | {r['prefetch']} | {r['slowed_copies']} | {r['bitwise']} | "
                  f"{r['max_difference_8bit']} | {r['error'] or ''} |" for r in rows]
        lines.append("")
    found = parts.get("sweep", {})
    if found.get("rows"):
        lines += [f"Sweep: Flux-width transformer at {found['size']}x{found['size']}, {found['forwards_timed']} "
                  "forwards timed after a warm-up.", "",
                  "| run | streamed per forward | s/forward | copy-bound s | compute-bound s | ratio | "
                  "peak allocated | peak reserved | pinned | note |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in found["rows"]:
            note = r.get("skipped") or r.get("error") or (
                f"activations {_size(r['activation_measured_bytes'])} measured, "
                f"{_size(r['activation_estimate_bytes'])} estimated ({r['activation_margin']:.2f}x)"
                if r.get("activation_margin") else "")
            lines.append(f"| {r['run']} | {_size(r.get('streamed_bytes_per_forward'))} | "
                         f"{_seconds(r.get('seconds_per_forward'))} | {_seconds(r.get('copy_bound_seconds'))} | "
                         f"{_seconds(r.get('compute_bound_seconds'))} | "
                         f"{_seconds(r.get('ratio_to_bound'))} | {_size(r.get('max_allocated_bytes'))} | "
                         f"{_size(r.get('max_reserved_bytes'))} | {_size(r.get('pinned_bytes'))} | {note} |")
        lines.append("")
    found = parts.get("quantized", {})
    if found.get("rows"):
        files = ", ".join(f"{kind} {_size(size)}" for kind, size in found["file_bytes"].items())
        lines += [f"Quantized: the Flux-width transformer as GGUF ({files}) at {found['size']}x{found['size']}, "
                  f"{found['forwards_timed']} "
                  "forwards timed after a warm-up; outputs against memfit's all-resident one "
                  "(benchmarks/gpu_quantized.py).", "",
                  "| type | run | streamed per forward | s/forward | peak allocated | peak reserved | "
                  "bitwise | max relative difference | note |", "|---|---|---|---|---|---|---|---|---|"]
        for r in found["rows"]:
            relative = r.get("relative_difference_to_memfit_resident")
            lines.append(f"| {r['type']} | {r['run']} | {_size(r.get('streamed_bytes_per_forward'))} | "
                         f"{_seconds(r.get('seconds_per_forward'))} | {_size(r.get('max_allocated_bytes'))} | "
                         f"{_size(r.get('max_reserved_bytes'))} | {r.get('bitwise_to_memfit_resident', '-')} | "
                         f"{'-' if relative is None else format(relative, '.2e')} | "
                         f"{r.get('skipped') or r.get('error') or budget_note(r)} |")
        lines.append("")
    found = parts.get("profile", {})
    if found.get("top"):
        lines += [f"Profiled forward (25% resident; {found['time_column']}, copies {found['copy_us']:.0f} us; trace "
                  f"{found['trace']}):", "", "| op | calls | self us |", "|---|---|---|"]
        lines += [f"| {e['name']} | {e['calls']} | {e['self_us']} |" for e in found["top"]]
        lines.append("")
    found = parts.get("sanitizer", {})
    if "passed" in found:
        lines += [f"TORCH_CUDA_SANITIZER=1 over a streamed run: {'passed' if found['passed'] else 'FAILED'}.", ""]
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="no GPU: memfit's fake CUDA runtime, tiny sizes")
    parser.add_argument("--out-dir",
                        help="where gpu_check.json and .md go (default: docs/, a temporary folder with --fake)")
    parser.add_argument("--size", type=int, help="image side of the sweep (default 1024; 64 with --fake)")
    parser.add_argument("--double", type=int, default=4, help="double-stream blocks of the sweep's transformer")
    parser.add_argument("--single", type=int, default=8, help="single-stream blocks of the sweep's transformer")
    parser.add_argument("--steps", type=int, default=5, help="forwards timed per sweep row, after a warm-up")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds after which parts are skipped")
    parser.add_argument("--parts", help="run only these parts, comma-separated (the sweep and the profile need build)")
    parser.add_argument("--sanitizer-run", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sanitizer_run:
        return sanitizer_run(Path(args.sanitizer_run))

    import gpu_quantized
    import torch

    from memfit.devices import runtime_for
    from memfit.testing import save_pipeline
    from memfit.testing.fake_cuda import fake_cuda

    if not args.fake and not torch.cuda.is_available():
        print("no CUDA device here: run with --fake to check the script on memfit's fake CUDA runtime", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir) if args.out_dir else (
        Path(tempfile.mkdtemp(prefix="gpu-check-")) if args.fake else HERE.parent / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-models-"))
    check = Check(args.deadline, out_dir, set(args.parts.split(",")) if args.parts else set())
    size = args.size or (64 if args.fake else 1024)
    text_tokens = 8 if args.fake else 512
    dtype = torch.float32 if args.fake else torch.bfloat16
    try:
        with fake_cuda(lazy=True) if args.fake else contextlib.nullcontext() as fake:
            runtime = fake if args.fake else runtime_for("cuda")
            name = runtime.name if args.fake else f"{runtime.name} ({torch.cuda.get_device_name(runtime.device)})"
            check.data.update(device=name, torch=torch.__version__, fake=args.fake, wall_seconds=0.0)
            sd = save_pipeline("sd", work / "sd", seed=0)
            found = check.part("bandwidth", lambda: bandwidth(runtime, (1 << 20) if args.fake else 256 << 20))
            per_s = (found or {}).get("pinned_bytes_per_s") or 1e9
            check.part("correctness", lambda: correctness(runtime, sd, (False,) if args.fake else (False, True),
                                                          passes=1 if args.fake else 2), needs=30)
            if args.fake:
                check.data["parts"]["sanitizer"] = {"skipped": "needs CUDA"}
            else:
                check.part("sanitizer", lambda: sanitizer(sd, timeout=90), needs=100)
            flux = work / "flux"
            config = {**(TINY_FLUX if args.fake else FLUX_WIDTHS), "num_layers": args.double,
                      "num_single_layers": args.single}
            built = check.part("build", lambda: build_transformer(flux, config, "cpu" if args.fake else runtime.device,
                                                                  dtype) or {"folder": str(flux)}, needs=60)
            check.part("quantized", lambda: gpu_quantized.quantized(
                runtime, work, config, size=size, text_tokens=text_tokens, steps=args.steps, dtype=dtype,
                with_diffusers=not args.fake, check=check), needs=90)
            if built and "error" not in built:
                check.part("sweep", lambda: sweep(runtime, flux, size=size, text_tokens=text_tokens, steps=args.steps,
                                                  dtype=dtype, bandwidth_per_s=per_s, group_offload=not args.fake,
                                                  check=check), needs=60)
                check.part("profile", lambda: profile(runtime, flux, out_dir, size=size, text_tokens=text_tokens,
                                                      dtype=dtype), needs=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    check.save()
    print(f"wrote {out_dir / 'gpu_check.json'} and .md", flush=True)
    parts = check.data["parts"]
    failed = [name for name, part in parts.items() if "error" in part]
    failed += ["correctness"] if any(not row["bitwise"] for row in parts.get("correctness", {}).get("rows", [])) else []
    failed += ["sanitizer"] if parts.get("sanitizer", {}).get("passed") is False else []
    failed += ["quantized"] if gpu_quantized.failed(parts.get("quantized", {})) else []
    if failed:
        print(f"[gpu_check] failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
