"""Streaming a transformer larger than its share of the GPU: memfit against the bound and against
diffusers' own group offloading, plus bitwise parity of tiny pipelines on CUDA.

    python benchmarks/gpu_streaming.py                          # on a CUDA machine: builds the model, ~33 GB disk
    python benchmarks/gpu_streaming.py --parity                 # tiny pipelines of every family, TORCH_CUDA_SANITIZER=1
    python benchmarks/gpu_streaming.py --fake --out-dir /tmp/x  # no GPU: the same code on memfit's fake CUDA runtime

Speed: the FLUX.1-dev transformer (random bf16 weights, benchmarks/build_flux_random.py; the folder is
built first when it is missing) runs ``--steps`` denoising forwards at ``--size`` (1024: 4096 image
tokens, 512 text tokens), after one warm-up forward, with 100%, 50% and 25% of its weights resident
on the GPU (memfit.optimize with force_tiers: the last blocks stream from pinned host memory) and with
every block streamed; diffusers' ``enable_group_offload(onload_device, offload_type="block_level",
num_blocks_per_group=1, use_stream=True, record_stream=True)`` streams every block too and runs beside
memfit's 0% row at the same residency. Only the transformer runs: the text encoders and the VAE run
once per image, the transformer once per step, and streaming costs are per step.

Each row: seconds per step (median), the bound max(compute per step all-resident, bytes streamed per
step / pinned host-to-device bandwidth measured here) and the ratio to it, peak allocated and
reserved device memory and allocator retries while stepping, pinned host bytes, RSS. The target
(issue 14): memfit within 1.1x of the bound, and faster than group offloading at equal memory.

Parity (``--parity``): every tiny family (memfit.testing.PIPELINE_KINDS) generates with memfit on the
device, all resident and with its denoiser streamed, against plain diffusers on the same device; the
script re-runs itself under TORCH_CUDA_SANITIZER=1 (torch's stream-race checker) on CUDA. Bitwise is
expected (``--atol`` states another tolerance).

``--fake`` runs both on memfit's fake CUDA runtime on the CPU (a tiny Flux; diffusers' group
offloading needs real CUDA streams and is skipped): figures mean nothing, it shows the script works.
Output: docs/gpu_streaming.{json,md} on a GPU; ``--out-dir`` (default: a temporary folder) with ``--fake``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

RESIDENT_FRACTIONS = (1.0, 0.5, 0.25, 0.0)
DEFAULT_FOLDER = "/work/bench-models/flux-dev-random"
TEXT_TOKENS = 512  # Flux's max_sequence_length
GiB = 2**30


class Holder:
    """A pipeline-shaped holder of one component: memfit.optimize and place_whole read ``components``."""

    def __init__(self, name: str, module: torch.nn.Module):
        self.components = {name: module}


# --- the speed benchmark ---------------------------------------------------------------------------


def flux_inputs(transformer, size: int, text_tokens: int, device, dtype=None) -> dict:
    """One denoising forward's inputs at ``size`` x ``size`` (VAE 8x down, 2x2 patches), in ``dtype`` (default: the
    first parameter's, which a quantized model does not compute in)."""
    config = transformer.config
    tokens = (size // 16) ** 2
    side = size // 16
    generator = torch.Generator().manual_seed(0)
    dtype = dtype or next(transformer.parameters()).dtype
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    inputs = {
        "hidden_states": torch.randn(1, tokens, config.in_channels, generator=generator, dtype=dtype),
        "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, generator=generator,
                                             dtype=dtype),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator, dtype=dtype),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "img_ids": img_ids.reshape(tokens, 3).to(dtype),
        "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
        "return_dict": False,
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5], dtype=dtype)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def streamed_blocks(transformer, resident: float, where: str = "host") -> tuple[dict[str, str], int, int]:
    """force_tiers that stream the last blocks (from ``where``: "host" or "disk") until at most ``resident`` of the
    weights stay on the device; returns them with the bytes streamed per forward and the total."""
    from memfit.run.executor import live_blocks

    blocks = live_blocks("transformer", transformer)
    total = sum(block.bytes for block in blocks)
    tiers, streamed = {}, 0
    for block in reversed([b for b in blocks if not b.key.endswith("/rest")]):
        if total - streamed <= resident * total:
            break
        tiers[block.key] = where
        streamed += block.bytes
    return tiers, streamed, total


def pinned_bandwidth(runtime, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of copies from pinned host memory to the device, measured with the runtime's own copy."""
    arena = runtime.pinned_arena(nbytes)
    try:
        arena.fill_(1)
        stream = runtime.new_stream()
        with runtime.use_stream(stream):
            runtime.to_device(arena)  # warm-up
        runtime.synchronize()
        started = time.perf_counter()
        with runtime.use_stream(stream):
            copies = [runtime.to_device(arena) for _ in range(repeats)]
        runtime.synchronize()
        seconds = time.perf_counter() - started
        del copies
    finally:
        runtime.release_arena(arena)
    return repeats * nbytes / seconds


def time_steps(transformer, inputs: dict, runtime, steps: int) -> tuple[list[float], dict]:
    """Seconds of each forward after one warm-up, and the device's memory figures while stepping; under no_grad, as
    a pipeline denoises (with autograd on, every activation would be kept for a backward)."""
    with torch.no_grad():
        transformer(**inputs)  # warm-up: kernels chosen, first blocks brought in
        runtime.synchronize()
        runtime.reset_peak_memory_stats()
        retries = runtime.alloc_retries()
        seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            transformer(**inputs)
            runtime.synchronize()
            seconds.append(time.perf_counter() - started)
    return seconds, {
        "max_allocated_bytes": runtime.max_memory_allocated(),
        "max_reserved_bytes": runtime.max_memory_reserved(),
        "alloc_retries": runtime.alloc_retries() - retries,
        "rss_bytes": psutil.Process().memory_info().rss,
    }


def record_row(rows: list, row: dict, runtime) -> None:
    """Keep a finished row, give its device memory back to the next, and print it (without its per-step times)."""
    rows.append(row)
    runtime.empty_cache()
    print(json.dumps({k: v for k, v in row.items() if k != "step_seconds"}), flush=True)


def host_pinned_bytes() -> int | None:
    """Bytes torch's pinned host allocator holds (diffusers pins through it), where torch reports it."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return int(stats().get("allocated_bytes.current", stats().get("reserved_bytes.current", 0)))
    except RuntimeError:
        return None


def load_transformer(folder: Path, dtype):
    import diffusers

    from memfit.models.folder import dtype_keyword

    model = diffusers.FluxTransformer2DModel.from_pretrained(folder / "transformer", **{dtype_keyword(): dtype})
    return model.eval()


def speed_rows(folder: Path, runtime, *, size: int, steps: int, text_tokens: int, group_offload: bool) -> tuple[list, dict]:
    import memfit
    from memfit.run.fit import place_whole

    dtype = torch.bfloat16 if runtime.device.type == "cuda" else torch.float32
    probe = load_transformer(folder, dtype)
    bandwidth = pinned_bandwidth(runtime, min(GiB, max(1 << 20, sum(
        p.numel() * p.element_size() for p in probe.parameters()) // 4)))
    del probe
    rows, compute = [], None
    for resident in RESIDENT_FRACTIONS:
        transformer = load_transformer(folder, dtype)
        holder = Holder("transformer", transformer)
        tiers, streamed, total = streamed_blocks(transformer, resident)
        if tiers:
            memfit.optimize(holder, force_tiers=tiers, device=runtime)
        else:
            place_whole(holder, runtime)
        inputs = flux_inputs(transformer, size, text_tokens, runtime.device)
        seconds, memory = time_steps(transformer, inputs, runtime, steps)
        per_step = statistics.median(seconds)
        if not tiers:
            compute = per_step
        bound = max(compute, streamed / bandwidth)
        rows.append({"run": f"memfit {round(resident * 100)}% resident", "resident_fraction": resident,
                     "weights_bytes": total, "streamed_bytes_per_step": streamed, "seconds_per_step": per_step,
                     "step_seconds": seconds, "bound_seconds": bound, "ratio_to_bound": per_step / bound,
                     "pinned_bytes": runtime.pinned_bytes(), **memory})
        if tiers:
            memfit.restore(holder)
        del transformer, holder, inputs
        gc.collect()
        runtime.empty_cache()
    if group_offload:
        rows.append(diffusers_group_offload_row(folder, runtime, dtype, size=size, steps=steps,
                                                text_tokens=text_tokens, compute=compute, bandwidth=bandwidth))
    return rows, {"pinned_bandwidth_bytes_per_s": bandwidth, "compute_seconds_per_step_all_resident": compute}


def diffusers_group_offload_row(folder, runtime, dtype, *, size, steps, text_tokens, compute, bandwidth) -> dict:
    transformer = load_transformer(folder, dtype)
    total = sum(p.numel() * p.element_size() for p in transformer.parameters())
    pinned_before = host_pinned_bytes()
    transformer.enable_group_offload(runtime.device, offload_type="block_level", num_blocks_per_group=1,
                                     use_stream=True, record_stream=True)
    inputs = flux_inputs(transformer, size, text_tokens, runtime.device)
    seconds, memory = time_steps(transformer, inputs, runtime, steps)
    per_step = statistics.median(seconds)
    pinned_after = host_pinned_bytes()
    bound = max(compute, total / bandwidth)
    row = {"run": "diffusers group offload (block_level, 1 block, stream)", "resident_fraction": 0.0,
           "weights_bytes": total, "streamed_bytes_per_step": total, "seconds_per_step": per_step,
           "step_seconds": seconds, "bound_seconds": bound, "ratio_to_bound": per_step / bound,
           "pinned_bytes": None if pinned_after is None else pinned_after - (pinned_before or 0), **memory}
    del transformer, inputs
    gc.collect()
    runtime.empty_cache()
    return row


# --- parity ------------------------------------------------------------------------------------------


def parity_rows(kinds, device: str, workdir: Path, atol: int) -> list[dict]:
    """memfit (all resident, and with the denoiser streamed) against plain diffusers on ``device``."""
    from memfit.plan import meta

    # Calibrated activation sizes are real-size workspace: a tiny model's streaming budget would be refused.
    # Set for these runs only and put back after: the caller's process (a test session) goes on.
    saved = meta.ACTIVATION_OFFSETS, meta.ACTIVATION_FACTORS, os.environ.get("MEMFIT_CACHE")
    meta.ACTIVATION_OFFSETS = dict.fromkeys(meta.ACTIVATION_OFFSETS, 0)
    meta.ACTIVATION_FACTORS = dict.fromkeys(meta.ACTIVATION_FACTORS, 0)
    os.environ["MEMFIT_CACHE"] = "0"
    try:
        return _parity_rows(kinds, device, workdir, atol)
    finally:
        meta.ACTIVATION_OFFSETS, meta.ACTIVATION_FACTORS, cache = saved
        if cache is None:
            os.environ.pop("MEMFIT_CACHE", None)
        else:
            os.environ["MEMFIT_CACHE"] = cache


def _parity_rows(kinds, device: str, workdir: Path, atol: int) -> list[dict]:
    import diffusers

    import memfit
    from memfit.models.folder import ModelFolder, dtype_keyword
    from memfit.testing import save_pipeline
    from memfit.testing.parity import max_pixel_difference
    from memfit.testing.pipelines import DEFAULT_SIZE

    rows = []
    for kind in kinds:
        folder = save_pipeline(kind, workdir / kind, seed=0)
        size = DEFAULT_SIZE.get(kind, 32)
        run = dict(prompt="a red circle", steps=2, seed=0, width=size, height=size, progress=False)
        if kind == "wan":
            run.update(width=32, height=32)
        adapter = ModelFolder.open(folder).adapter
        denoiser = next(name for name in ("transformer", "unet") if (Path(folder) / name).is_dir())
        weights = sum(f.stat().st_size for f in (Path(folder) / denoiser).glob("*.safetensors"))
        for label, budget in (("all resident", "none"), ("denoiser streamed", {"device": weights // 2, "host": GiB})):
            try:
                ours = generate_within(memfit, folder, device, budget, run)
                settings = ours.settings
                pipe = diffusers.DiffusionPipeline.from_pretrained(folder, **{dtype_keyword(): torch.float32})
                if not device.startswith("cuda") or torch.cuda.is_available():
                    pipe = pipe.to(device)
                pipe.set_progress_bar_config(disable=True)
                output = pipe(prompt=settings.prompt, **adapter.call_kwargs(settings),
                              generator=torch.Generator(device="cpu").manual_seed(settings.seed), output_type="pil")
                reference = list(output.images) if getattr(output, "images", None) is not None else list(output.frames[0])
                difference = max_pixel_difference(ours.frames if ours.frames is not None else ours.images, reference)
                rows.append({"family": kind, "run": label, "max_pixel_difference": difference,
                             "passed": difference <= atol, "error": None})
            except Exception as exc:  # one family's failure must not hide the others'
                rows.append({"family": kind, "run": label, "max_pixel_difference": None, "passed": False,
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def generate_within(memfit, folder, device, budget, run):
    """memfit.generate under ``budget``; raised once to the floor memfit names when that is too small."""
    import re

    from memfit.errors import MemfitError

    try:
        return memfit.generate(model=folder, device=device, budget=budget, **run)
    except MemfitError as exc:
        found = re.search(r"smallest device budget that works is (\d+) bytes", str(exc))
        if not found or not isinstance(budget, dict):
            raise
    return memfit.generate(model=folder, device=device, budget={**budget, "device": int(found.group(1))}, **run)


# --- output ---------------------------------------------------------------------------------------------


def _size(value) -> str:
    from memfit.sizes import format_bytes

    return "-" if value is None else format_bytes(value)


def markdown(data: dict) -> str:
    lines = [f"# GPU streaming ({data['device']})", "", data["what"], ""]
    if data.get("speed"):
        extra = data["speed_setup"]
        lines += [f"Pinned host-to-device bandwidth: {extra['pinned_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
                  f"compute per step all resident: {extra['compute_seconds_per_step_all_resident']:.3f} s.", "",
                  "| run | streamed per step | s/step | bound s | ratio | max allocated | max reserved | "
                  "alloc retries | pinned | RSS |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in data["speed"]:
            lines.append(f"| {row['run']} | {_size(row['streamed_bytes_per_step'])} | {row['seconds_per_step']:.3f} | "
                         f"{row['bound_seconds']:.3f} | {row['ratio_to_bound']:.2f} | {_size(row['max_allocated_bytes'])} | "
                         f"{_size(row['max_reserved_bytes'])} | {row['alloc_retries']} | {_size(row['pinned_bytes'])} | "
                         f"{_size(row['rss_bytes'])} |")
        lines.append("")
    if data.get("parity"):
        lines += [f"Parity ({data['parity_setup']}):", "", "| family | run | max pixel difference | passed | error |",
                  "|---|---|---|---|---|"]
        for row in data["parity"]:
            lines.append(f"| {row['family']} | {row['run']} | {row['max_pixel_difference']} | {row['passed']} | "
                         f"{row['error'] or ''} |")
        lines.append("")
    return "\n".join(lines)


def write(data: dict, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(data))
    print(f"wrote {out_dir / name}.json and .md")


# --- main -------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=DEFAULT_FOLDER, help="the random-weight FLUX.1-dev folder (built if missing)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="timed forwards per row, after one warm-up")
    parser.add_argument("--parity", action="store_true", help="run the tiny-family parity check (and no speed rows)")
    parser.add_argument("--families", help="comma-separated tiny families for --parity (default: every one)")
    parser.add_argument("--atol", type=int, default=0, help="largest pixel difference --parity accepts (default 0)")
    parser.add_argument("--fake", action="store_true", help="no GPU: run on memfit's fake CUDA runtime, a tiny Flux")
    parser.add_argument("--out-dir", help="where the JSON and markdown go (default: docs/, or a temporary folder with --fake)")
    args = parser.parse_args(argv)

    if args.parity and not args.fake and os.environ.get("TORCH_CUDA_SANITIZER") != "1":
        # torch reads the variable when it initialises CUDA: run again with it set from the start.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TORCH_CUDA_SANITIZER": "1"})
    if not args.fake and not torch.cuda.is_available():
        print("no CUDA device here: run with --fake to check the script on memfit's fake CUDA runtime", file=sys.stderr)
        return 2
    from memfit.devices import runtime_for
    from memfit.testing import PIPELINE_KINDS, save_pipeline
    from memfit.testing.fake_cuda import fake_cuda

    out_dir = Path(args.out_dir) if args.out_dir else (
        Path(tempfile.mkdtemp(prefix="gpu-streaming-")) if args.fake else Path(__file__).resolve().parent.parent / "docs")
    workdir = Path(tempfile.mkdtemp(prefix="gpu-streaming-models-"))
    gpu = fake_cuda(lazy=True) if args.fake else contextlib.nullcontext()
    # The fake's deferred copies may run after a forward returns, into tensors made inside it.
    with gpu as fake, torch.inference_mode():
        runtime = fake if args.fake else runtime_for("cuda")
        device_name = runtime.name if args.fake else f"{runtime.name} ({torch.cuda.get_device_name(runtime.device)})"
        data = {"device": device_name, "torch": torch.__version__,
                "what": "FLUX.1-dev transformer, random weights, per-step streaming; see benchmarks/gpu_streaming.py"}
        if args.parity:
            kinds = args.families.split(",") if args.families else list(PIPELINE_KINDS)
            data["parity"] = parity_rows(kinds, "cuda", workdir, args.atol)
            data["parity_setup"] = (f"memfit vs plain diffusers on {device_name}, fp32, 2 steps, atol {args.atol}, "
                                    f"TORCH_CUDA_SANITIZER={os.environ.get('TORCH_CUDA_SANITIZER', '0')}")
            name = "gpu_streaming_parity"
        else:
            if args.fake:
                folder, size, text_tokens = save_pipeline("flux", workdir / "flux", seed=0), 64, 8
            else:
                from build_flux_random import build

                folder, size, text_tokens = build(Path(args.folder)), args.size, TEXT_TOKENS
            rows, setup = speed_rows(Path(folder), runtime, size=size, steps=args.steps, text_tokens=text_tokens,
                                     group_offload=not args.fake)
            data.update(speed=rows, speed_setup={**setup, "size": size, "steps": args.steps, "text_tokens": text_tokens,
                                                 "group_offload": "run" if not args.fake else "skipped: needs CUDA"})
            name = "gpu_streaming"
    write(data, out_dir, name)
    failed = [row for row in data.get("parity", []) if not row["passed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
