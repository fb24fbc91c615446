"""Shared by the benchmarks: real-size pipelines with random weights, built once and saved.

Memory and speed do not depend on weight values, so the real architectures (memfit.models.archs
configs, exact parameter counts) with random weights measure what users see, without a hub.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from memfit.models.archs import get_arch
from memfit.testing import clip_tokenizer


def _component(spec, dtype):
    if spec.library == "diffusers":
        import diffusers

        cls = getattr(diffusers, spec.class_name)
        return cls.from_config(dict(spec.config)).to(dtype)
    import transformers

    cls = getattr(transformers, spec.class_name)
    return cls(cls.config_class(**dict(spec.config))).to(dtype).eval()


def build_real_size(arch_name: str, folder: str | Path, *, file_dtype=torch.float32, seed: int = 0) -> Path:
    """Save arch_name (sd15 or sdxl) with random weights at `folder`, unless already there."""
    folder = Path(folder)
    done = folder / "model_index.json"
    if done.is_file():
        return folder
    import diffusers

    torch.manual_seed(seed)
    arch = get_arch(arch_name)
    started = time.perf_counter()
    parts = {spec.name: _component(spec, file_dtype) for spec in arch.components}
    tokenizer = clip_tokenizer(model_max_length=77)
    scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )
    if arch_name == "sd15":
        pipe = diffusers.StableDiffusionPipeline(
            **parts, tokenizer=tokenizer, scheduler=scheduler, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )
    elif arch_name == "sdxl":
        pipe = diffusers.StableDiffusionXLPipeline(**parts, tokenizer=tokenizer, tokenizer_2=clip_tokenizer(model_max_length=77), scheduler=scheduler)
    else:
        raise ValueError(f"no pipeline assembly for {arch_name}")
    pipe.save_pretrained(folder, safe_serialization=True)
    print(f"built {arch_name} ({file_dtype}) at {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def tiny_sd(models: str | Path) -> Path:
    """A tiny SD pipeline (memfit.testing, fixed seed) under ``models``, for smoke runs of a benchmark."""
    from memfit.testing import save_pipeline

    model = Path(models) / "sd-tiny"
    if not (model / "model_index.json").is_file():
        save_pipeline("sd", model, seed=0)
    return model


def max_difference(image: Path, reference: Path) -> int | None:
    """The largest per-pixel difference (0..255) between two image files; None if either is missing."""
    import numpy as np
    from PIL import Image

    if not (image.is_file() and reference.is_file()):
        return None
    a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=int) for p in (image, reference))
    return int(np.abs(a - b).max())


def write_outputs(name: str, data: dict, table: str) -> None:
    docs = Path(__file__).resolve().parent.parent / "docs"
    docs.mkdir(exist_ok=True)
    (docs / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (docs / f"{name}.md").write_text(table)
    print(f"wrote docs/{name}.json and docs/{name}.md")


def cpu_name() -> str | None:
    """The CPU's model name and whether it computes bf16 in hardware (AVX-512 BF16 or AMX): without it, a bf16
    run is emulated (torch) or runs in fp32 (OpenVINO), which changes what a benchmark compares."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = " ".join(fields.get("model name\t", "").split())
    if not name:
        return None
    flags = set(fields.get("flags\t\t", "").split())
    return f"{name}, {'bf16 in hardware' if flags & {'avx512_bf16', 'amx_bf16'} else 'no bf16 in hardware'}"


def machine() -> dict:
    import platform

    import psutil

    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
