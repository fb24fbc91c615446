"""Quantized weights side by side: what each type costs in quality and speed, and what it saves in memory.

    python benchmarks/quantized.py --models /work/bench-models/quantized            # all three parts
    python benchmarks/quantized.py --models DIR --parts quality,speed              # the quick ones

Writes docs/quantized_weights.{json,md} (a run of some parts keeps the others' last figures). Three parts:

* **quality**: a Flux-width transformer (FLUX.1-dev's block widths, one double and one single block, random
  weights) read from each quantized file as users hold them (GGUF in Black Forest Labs' keys, quantized by
  the gguf package as city96's converter does; fp8 and Comfy's scaled fp8), its output on fixed inputs
  against the unquantized model's: max and mean absolute error, next to the stored bytes; and the
  built-in demo model's image with its UNet quantized on the fly (``quantize={"unet": TYPE}``), PSNR
  against its fp32 image.
* **speed**: the same transformer's forward at 512x512 (1024 image tokens, 512 text tokens) in bf16 compute,
  every weight in memory, per type, in interleaved rounds: the dequantization overhead against bf16
  weights, what a run with room to keep the weights dequantized gets, and diffusers' own GGUF path
  (from_single_file + GGUFQuantizationConfig) on the same file.
* **memory**: the real FLUX.1-dev transformer (12B) as GGUF Q4_0 and Q8_0 (real layout and size, random
  valid blocks: speed and memory do not depend on values), one forward at 256x256 in a fresh process per
  row, under cgroup caps and without: memfit (no flag) against
  diffusers' GGUF loading, which copies the file into memory; and memfit with a budget under the cap, which
  plans streaming from the file. The configs folder and the files are built under ``--models`` once
  (about 20 GB; leave ``memory`` out of ``--parts`` to skip it).

torch runs with the threads stated in the output (2 on the benchmark machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30
FILE_TYPES = ["Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "fp8", "fp8-scaled"]
# The Flux-width transformer quantized on the fly (memfit's file, diffusers' keys): the types no downloaded file
# holds here (int8 is memfit's own; the gguf package cannot write K-quants), and q8_0 and q4_0 beside them, since
# on the fly keeps the first and last layers (embedders, norm_out, proj_out) as downloaded GGUF files do, while
# the "file" rows above quantize every linear weight.
ON_THE_FLY_FILE_TYPES = ["q8_0", "q4_0", "int8", "q6_k", "q5_k", "q4_k", "q3_k", "q2_k"]
ON_THE_FLY = ["fp8", "int8", "q8_0", "q5_0", "q4_0", "q6_k", "q5_k", "q4_k", "q3_k", "q2_k"]
SPEED_TYPES = ["bf16", "Q8_0", "Q4_0", "fp8"]


# --- the Flux-width model ---------------------------------------------------------------------------

def flux_width_folder(models: Path) -> Path:
    """A tiny Flux pipeline folder whose transformer has FLUX.1-dev's widths with one block of each kind."""
    from diffusers import FluxTransformer2DModel

    from memfit.testing import save_pipeline

    folder = models / "flux-width"
    if (folder / "transformer" / "config.json").is_file() and (folder / "model_index.json").is_file():
        return folder
    save_pipeline("flux", folder, seed=0)
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    for file in (folder / "transformer").iterdir():
        file.unlink()
    transformer.save_pretrained(folder / "transformer")
    return folder


def quantized_file(folder: Path, out: Path, kind: str) -> Path:
    """The Flux-width transformer as users hold it in ``kind``: GGUF or fp8 safetensors, Black Forest Labs' keys."""
    from diffusers import FluxTransformer2DModel

    from memfit.testing.quantized import save_fp8, save_gguf
    from memfit.testing.single_file import flux_bfl_state_dict

    path = out / (f"flux-width-{kind}.gguf" if kind.startswith("Q") else f"flux-width-{kind}.safetensors")
    if not path.exists():
        state = flux_bfl_state_dict(FluxTransformer2DModel.from_pretrained(folder / "transformer"))
        if kind.startswith("Q"):
            save_gguf(state, path, kind)
        else:
            save_fp8(state, path, scaled=kind == "fp8-scaled")
    return path


def load_transformer(folder: Path, file: Path | None, dtype: torch.dtype, quantize: str | None = None):
    from memfit.models.folder import ModelFolder
    from memfit.models.quantize import with_quantized
    from memfit.models.single_file import SingleFileModel

    model = ModelFolder.open(folder)
    if file is not None:
        model = SingleFileModel.with_components(model, {"transformer": file})
    if quantize is not None:
        model = with_quantized(model, {"transformer": quantize})
    return model.load_stage(["transformer"], dtype, in_file_dtype=[]).transformer


def inputs(transformer, image_tokens: int, text_tokens: int, dtype: torch.dtype) -> dict:
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, image_tokens, config.in_channels, generator=generator).to(dtype),
                encoder_hidden_states=torch.randn(1, text_tokens, config.joint_attention_dim, generator=generator)
                .to(dtype),
                pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=generator).to(dtype),
                timestep=torch.tensor([0.5], dtype=dtype), guidance=torch.tensor([3.5], dtype=dtype),
                img_ids=torch.zeros(image_tokens, 3), txt_ids=torch.zeros(text_tokens, 3))


def stored_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# --- quality ----------------------------------------------------------------------------------------

def quality(models: Path, only: list[str] | None = None, earlier: dict | None = None) -> dict:
    """The quality rows; with ``only``, those types' rows alone, the others kept from ``earlier`` (the page's)."""
    import memfit
    from memfit.errors import MemfitError

    wanted = lambda kind: only is None or kind in only  # noqa: E731
    folder = flux_width_folder(models)
    reference = load_transformer(folder, None, torch.float32)
    feed = inputs(reference, 256, 128, torch.float32)
    with torch.no_grad():
        expected = reference(**feed).sample
    rows = [{"type": "fp32 (unquantized)", "stored_bytes": stored_bytes(reference), "max_abs_error": 0.0,
             "mean_abs_error": 0.0}]
    for kind in [*FILE_TYPES, *ON_THE_FLY_FILE_TYPES]:
        if not wanted(kind):
            rows += [row for row in (earlier or {}).get("flux_width", []) if row["type"] == kind]
            continue
        if kind in ON_THE_FLY_FILE_TYPES:
            transformer = load_transformer(folder, None, torch.float32, quantize=kind)
        else:
            transformer = load_transformer(folder, quantized_file(folder, models, kind), torch.float32)
        with torch.no_grad():
            error = (transformer(**feed).sample - expected).abs()
        rows.append({"type": kind, "stored_bytes": stored_bytes(transformer), "max_abs_error": error.max().item(),
                     "mean_abs_error": error.mean().item(), "on_the_fly": kind in ON_THE_FLY_FILE_TYPES})
        print(f"quality {kind}: {rows[-1]}", flush=True)
    output_scale = expected.abs().mean().item()

    demo = []
    fp32 = np.asarray(memfit.generate("a red house near the sea", seed=0, progress=False, budget="none").images[0],
                      dtype=np.float64)
    for kind in ON_THE_FLY:
        if not wanted(kind):
            demo += [row for row in (earlier or {}).get("demo", []) if row["type"] == kind]
            continue
        try:
            result = memfit.generate("a red house near the sea", seed=0, progress=False, budget="none",
                                     quantize={"unet": kind})
        except MemfitError as exc:  # q4_k: a UNet with no linear layer 256 values wide
            demo.append({"type": kind, "refused": str(exc)})
            print(f"demo {kind}: refused: {exc}", flush=True)
            continue
        image = np.asarray(result.images[0], dtype=np.float64)
        mse = float(np.mean((image - fp32) ** 2))
        demo.append({"type": kind, "psnr_db": math.inf if mse == 0 else 10 * math.log10(255**2 / mse),
                     "max_pixel_difference": int(np.abs(image - fp32).max())})
        print(f"demo {kind}: {demo[-1]}", flush=True)
    return {"flux_width": rows, "output_mean_abs": output_scale, "demo": demo}


# --- speed ------------------------------------------------------------------------------------------

def speed(models: Path, rounds: int, repeats: int) -> dict:
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    from memfit.quant.layers import QuantizedLinear

    folder = flux_width_folder(models)
    loaded = {kind: load_transformer(folder, None if kind == "bf16" else quantized_file(folder, models, kind),
                                     torch.bfloat16) for kind in SPEED_TYPES}
    # What a run whose budget has room for them does (memfit.run.executor.keep_dequantized): resident quantized
    # weights dequantized once.
    loaded["Q8_0, room to keep it dequantized"] = load_transformer(folder, quantized_file(folder, models, "Q8_0"),
                                                                   torch.bfloat16)
    for layer in loaded["Q8_0, room to keep it dequantized"].modules():
        if isinstance(layer, QuantizedLinear):
            layer.dequantized = layer.dequantize_weight(torch.bfloat16)
    loaded["diffusers GGUF Q8_0"] = FluxTransformer2DModel.from_single_file(
        str(quantized_file(folder, models, "Q8_0")), config=str(folder), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16), torch_dtype=torch.bfloat16)
    feed = inputs(loaded["bf16"], 1024, 512, torch.bfloat16)
    times: dict[str, list[float]] = {kind: [] for kind in loaded}
    with torch.no_grad():
        for kind, transformer in loaded.items():
            transformer(**feed)  # warm-up: allocator, kernels
        for round_ in range(rounds):
            for kind, transformer in loaded.items():
                for _ in range(repeats):
                    started = time.perf_counter()
                    transformer(**feed)
                    times[kind].append(time.perf_counter() - started)
            print(f"speed round {round_ + 1}: " + ", ".join(f"{k} {statistics.median(v):.3f}s" for k, v in times.items()),
                  flush=True)
    base = statistics.median(times["bf16"])
    return {"threads": torch.get_num_threads(), "image_tokens": 1024, "text_tokens": 512, "rounds": rounds,
            "rows": [{"type": kind, "median_seconds": statistics.median(v), "vs_bf16": statistics.median(v) / base,
                      "stored_bytes": stored_bytes(loaded[kind]), "seconds": v} for kind, v in times.items()]}


# --- memory (real size) -----------------------------------------------------------------------------

def flux_configs(models: Path) -> Path:
    """FLUX.1-dev's configs, scheduler and tokenizers, no weights (what --config gives a GGUF transformer)."""
    import diffusers
    from build_flux_random import FLUX_DEV_SCHEDULER, meta_model

    from memfit.models.archs import get_arch
    from memfit.testing import clip_tokenizer, word_tokenizer

    folder = models / "flux-dev-configs"
    if (folder / "model_index.json").is_file():
        return folder
    for spec in get_arch("flux").components:
        model = meta_model(spec)
        if spec.library == "diffusers":
            model.save_config(folder / spec.name)
        else:
            model.config.save_pretrained(folder / spec.name)
    clip_tokenizer(model_max_length=77).save_pretrained(folder / "tokenizer")
    word_tokenizer(model_max_length=512).save_pretrained(folder / "tokenizer_2")
    diffusers.FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV_SCHEDULER).save_pretrained(folder / "scheduler")
    index = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
             "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def real_gguf(models: Path, kind: str) -> Path:
    """flux1-dev-{kind}.gguf: FLUX.1-dev's transformer in Black Forest Labs' keys, as city96's files hold it:
    weights whose rows are whole blocks in ``kind`` (random valid blocks: Q8_0, Q4_0, Q4_K), the rest F32."""
    from build_flux_random import meta_model

    from memfit.models.archs import get_arch
    from memfit.testing.single_file import flux_bfl_state_dict

    path = models / f"flux1-dev-{kind}.gguf"
    if path.exists():
        return path
    spec = next(spec for spec in get_arch("flux").components if spec.name == "transformer")
    random_gguf(path, {key: tuple(value.shape) for key, value in flux_bfl_state_dict(meta_model(spec)).items()}, kind)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.1f} GB)", flush=True)
    return path


def random_gguf(path: Path, shapes: dict[str, tuple[int, ...]], kind: str) -> Path:
    """A GGUF file of tensors ``shapes`` (key -> logical shape): the 2-D ones whose rows are whole blocks in ``kind``
    (random valid blocks, values about N(0, 0.02)), the rest random F32; written under a partial name first."""
    import gguf
    from build_flux_random import random_tensor

    from memfit.testing.quantized import random_blocks

    quant = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[quant][0]
    chosen = {key for key, shape in shapes.items() if len(shape) == 2 and shape[-1] % block == 0}
    scale = {"Q8_0": 2e-4, "Q4_0": 4e-3, "Q4_K": 1e-4}[kind]  # values about N(0, 0.02), as the bf16 benchmark models'
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, "flux")
    for key, shape in shapes.items():
        if key in chosen:
            stored = gguf.quant_shape_to_byte_shape(shape, quant)
            writer.add_tensor_info(key, stored, np.dtype(np.uint8), int(np.prod(stored)), raw_dtype=quant)
        else:
            writer.add_tensor_info(key, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = torch.Generator().manual_seed(0)
    for number, (key, shape) in enumerate(shapes.items()):
        if key in chosen:
            writer.write_tensor_data(_centred(random_blocks(kind, shape, seed=number, scale=scale), kind))
        else:
            writer.write_tensor_data(random_tensor(key, shape, torch.float32, generator).numpy())
    writer.close()
    partial.rename(path)
    return path


def _centred(data: np.ndarray, kind: str) -> np.ndarray:
    """Q4_K's random blocks with values centred on zero: a value is d * sc * q - dmin * m with q in 0..15 and sc, m
    in 0..63 drawn alike, so dmin = 7.5 d cancels the mean of d * sc * q. The other types centre already."""
    if kind != "Q4_K":
        return data
    blocks = data.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    blocks[:, 2:4] = (d * 7.5).astype(np.float16).view(np.uint8)
    return data


MEMORY_ROWS = [  # (row, type, cap in GiB or None, memfit's budget: None for the automatic one)
    ("memfit", "Q4_0", None, None), ("memfit", "Q4_0", 4, None), ("memfit", "Q4_0", 4, "3GiB"),
    ("diffusers", "Q4_0", None, None), ("diffusers", "Q4_0", 4, None),
    ("memfit", "Q8_0", 6, None), ("memfit", "Q8_0", 6, "5GiB"), ("diffusers", "Q8_0", None, None),
    ("diffusers", "Q8_0", 6, None),
]


def run_child(row: str, configs: str, file: str, budget: str | None) -> dict:
    """In the fresh process: load the transformer from ``file`` as ``row`` does, one forward; seconds and peaks."""
    from single_file import report_peaks

    report_peaks()
    import memfit

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    started = time.perf_counter()
    if row == "memfit":
        from diffusers import FluxPipeline

        transformer = load_transformer(Path(configs), Path(file), torch.bfloat16)
        pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                            tokenizer_2=None, transformer=transformer)
        # The automatic budget counts a pipeline optimize is given as held already: here the transformer's views
        # of the file, so it keeps them all "resident", read in place; the kernel drops and reads again what
        # the cap cannot hold. A budget given plans the streaming itself.
        memfit.optimize(pipe, budget=budget or "auto")
        plan = pipe._memfit_plan.stages[0]
        extra = {"resident_bytes": plan.resident_bytes, "streamed_bytes": plan.streamed_from_disk_bytes
                 + plan.streamed_from_host_bytes}
    else:
        from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

        transformer = FluxTransformer2DModel.from_single_file(
            file, config=configs, subfolder="transformer", torch_dtype=torch.bfloat16,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16))
        extra = {}
    loaded = time.perf_counter() - started
    feed = inputs(transformer, 256, 512, torch.bfloat16)
    with torch.no_grad():
        forward_started = time.perf_counter()
        transformer(**feed)
        forward = time.perf_counter() - forward_started
    return {"load_seconds": loaded, "forward_seconds": forward, "peak_rss": memfit.process_peak_rss(),
            "threads": torch.get_num_threads(), **extra}


def memory(models: Path, timeout: float, earlier: list[dict], only: str | None) -> list[dict]:
    """The MEMORY_ROWS (those whose description holds ``only``, the rest kept from ``earlier`` runs)."""
    from memfit.testing.cgroup import evict_page_cache, run_capped

    configs = flux_configs(models)
    files = {kind: real_gguf(models, kind) for kind in ("Q4_0", "Q8_0")}
    kept = {(r["row"], r["type"], r["cap_gib"], r.get("budget")): r for r in earlier}
    out = []
    for row, kind, cap, budget in MEMORY_ROWS:
        if only and only not in f"{row} {kind} {cap} {budget}" and (row, kind, cap, budget) in kept:
            out.append(kept[row, kind, cap, budget])
            continue
        evict_page_cache(models)
        command = [sys.executable, __file__, "--child", row, "--configs", str(configs), "--file", str(files[kind]),
                   *(["--budget", budget] if budget else [])]
        env = {**os.environ, "MEMFIT_CACHE": "0", "HF_HUB_OFFLINE": "1"}
        run = run_capped(command, cap * GiB if cap else None, timeout=timeout, env=env)
        lines = run.stdout.splitlines()
        result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
        peaks = [int(line[5:]) for line in lines if line.startswith("PEAK ")]
        entry = {"row": row, "type": kind, "cap_gib": cap, "budget": budget, "file_bytes": files[kind].stat().st_size,
                 "completed": run.completed and result is not None, "killed": run.killed,
                 "process_seconds": run.seconds, "cgroup_peak": run.max_usage_bytes, **(result or {})}
        if result is None:
            entry["peak_rss"] = max(peaks, default=None)
            if not run.killed:
                entry["error"] = (run.stderr.strip().splitlines() or ["(no output)"])[-1][-300:]
        print(f"memory {row} {kind} cap {cap}: {entry}", flush=True)
        out.append(entry)
    return out


# --- report -----------------------------------------------------------------------------------------

def _gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.2f} GiB"


def _elsewhere(row: dict, data: dict) -> str:
    """A row run again on another machine than the page's (``--types``) says which."""
    cpu = row.get("cpu")
    return f" (on {cpu})" if cpu and cpu != data["machine"]["cpu"] else ""


def render(data: dict) -> str:
    lines = ["# Quantized weights: quality, speed, memory", "",
             f"`python benchmarks/quantized.py` on {data['machine']['cpu']}, {data['machine']['cpu_count']} CPUs, "
             f"torch {data['machine']['torch']}; regenerate with the same command.", ""]
    if "quality" in data:
        quality_ = data["quality"]
        lines += ["## Quality", "",
                  "Flux-width transformer (FLUX.1-dev's widths, one double and one single block, random weights), its "
                  "output on fixed inputs (256 image and 128 text tokens, fp32 compute) against the unquantized model "
                  f"(mean |output| {quality_['output_mean_abs']:.3g}):", "",
                  "| type | stored bytes | of fp32 | max abs error | mean abs error |", "|---|---|---|---|---|"]
        fp32 = quality_["flux_width"][0]["stored_bytes"]
        for row in quality_["flux_width"]:
            label = row["type"] + (" (memfit's, on the fly)" if row.get("on_the_fly") else "") + _elsewhere(row, data)
            lines.append(f"| {label} | {row['stored_bytes'] / 1e6:.0f} MB | {row['stored_bytes'] / fp32:.3f} | "
                         f"{row['max_abs_error']:.3g} | {row['mean_abs_error']:.3g} |")
        lines += ["", "The built-in demo model with its UNet quantized on the fly (`quantize={\"unet\": TYPE}`), its "
                  "image against its fp32 image:", "", "| type | PSNR | max pixel difference |", "|---|---|---|"]
        for row in quality_["demo"]:
            if "refused" in row:
                lines.append(f"| {row['type']}{_elsewhere(row, data)} | refused: no layer 256 wide | - |")
                continue
            psnr = "identical" if math.isinf(row["psnr_db"]) else f"{row['psnr_db']:.1f} dB"
            lines.append(f"| {row['type']}{_elsewhere(row, data)} | {psnr} | {row['max_pixel_difference']}/255 |")
        lines.append("")
    if "speed" in data:
        speed_ = data["speed"]
        lines += ["## Speed", "",
                  f"The same transformer's forward at 512x512 ({speed_['image_tokens']} image tokens, "
                  f"{speed_['text_tokens']} text tokens), bf16 compute, every weight in memory, "
                  f"{speed_['threads']} threads, median of {speed_['rounds']} interleaved rounds:", "",
                  "| weights | stored bytes | median forward | vs bf16 |", "|---|---|---|---|"]
        for row in speed_["rows"]:
            lines.append(f"| {row['type']} | {row['stored_bytes'] / 1e6:.0f} MB | {row['median_seconds']:.3f} s | "
                         f"{row['vs_bf16']:.2f}x |")
        lines.append("")
    if "memory" in data:
        lines += ["## Memory at real size", "",
                  "FLUX.1-dev's transformer (12B) as GGUF (real layout and size, random valid blocks), loaded and run "
                  "once at 256x256 (256 image, 512 text tokens, bf16 compute) in a fresh process per row. memfit: the "
                  "transformer opened from the file (`--component transformer=FILE`) and `memfit.optimize`d; with no "
                  "flag the automatic budget counts the loaded views of the file as held, so the plan keeps them all "
                  "resident, read in place, and the kernel drops and reads again the pages a cap cannot hold; with a "
                  "budget the plan streams blocks from the file itself. diffusers: from_single_file with "
                  "GGUFQuantizationConfig, which copies the file into memory. Peak RSS counts the file's pages mapped "
                  "in; the cgroup peak counts page cache too.", "",
                  "| row | file | cap | outcome | load | forward | peak RSS | cgroup peak |", "|---|---|---|---|---|---|---|---|"]
        for row in data["memory"]:
            outcome = "completes" if row["completed"] else ("killed (out of memory)" if row["killed"] else "fails")
            load = f"{row['load_seconds']:.0f} s" if "load_seconds" in row else "-"
            forward = f"{row['forward_seconds']:.0f} s" if "forward_seconds" in row else "-"
            cap = f"{row['cap_gib']} GiB" if row["cap_gib"] else "none"
            name = f"memfit, budget {row['budget']}" if row.get("budget") else \
                ("memfit, no flag" if row["row"] == "memfit" else "diffusers GGUF")
            streamed = f", {_gib(row['streamed_bytes'])} streamed" if row.get("streamed_bytes") else ""
            lines.append(f"| {name}{streamed} | {row['type']} {row['file_bytes'] / 1e9:.1f} GB | {cap} | {outcome} | {load} | "
                         f"{forward} | {_gib(row.get('peak_rss'))} | {_gib(row['cgroup_peak'])} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path("/work/bench-models/quantized"))
    parser.add_argument("--parts", default="quality,speed,memory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child")
    parser.add_argument("--configs")
    parser.add_argument("--file")
    parser.add_argument("--budget")
    parser.add_argument("--types", help="quality rows to run again (comma-separated types, e.g. int8,q4_k); the "
                        "rest are kept from the page's last run")
    parser.add_argument("--only", help="memory rows to run again (a substring of 'ROW TYPE CAP BUDGET'); the rest "
                        "are kept from the page's last run")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args.configs, args.file, args.budget)), flush=True)
        return
    from common import machine, write_outputs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    args.models.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    # A run of some parts keeps the others' figures from the page's last run (the same machine's).
    page = Path(__file__).resolve().parent.parent / "docs" / "quantized_weights.json"
    data = json.loads(page.read_text()) if page.is_file() else {}
    if not args.types or "machine" not in data:  # rows run again alone keep the page's machine and name their own
        data["machine"] = machine()
    if "quality" in parts:
        earlier = data.get("quality")
        data["quality"] = quality(args.models, args.types.split(",") if args.types else None, earlier)
        if args.types:
            data["quality"]["output_mean_abs"] = earlier.get("output_mean_abs", data["quality"]["output_mean_abs"])
            for row in data["quality"]["flux_width"][1:] + data["quality"]["demo"]:
                if row["type"] in args.types.split(","):
                    row["cpu"] = machine()["cpu"]
    if "speed" in parts:
        data["speed"] = speed(args.models, args.rounds, args.repeats)
    if "memory" in parts:
        data["memory"] = memory(args.models, args.timeout, data.get("memory", []), args.only)
    write_outputs("quantized_weights", data, render(data))


if __name__ == "__main__":
    main()
