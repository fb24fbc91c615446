"""The GPU check's quantized part (benchmarks/gpu_check.py runs it as ``quantized``).

A Flux-width transformer (the check's block counts, FLUX.1's widths) as GGUF Q8_0 and Q4_0 files the way city96's
hold FLUX.1 (Black Forest Labs' keys, random valid blocks, the rest F32), run one forward per step at the check's
size in bf16:

* memfit (its stored-weight layers: the file's blocks on the device, dequantized per layer in each forward) with
  every weight resident, 25% and 0% resident (the rest streamed from pinned host memory in stored bytes), 25% read
  from the GGUF file's map, and planned from a device budget of half the stored bytes;
* diffusers' own GGUF loading (``from_single_file`` with ``GGUFQuantizationConfig``) on the same file, all on the
  device and with its group offloading (block_level, one block per group, use_stream=True).

Each row: seconds per forward (median after a warm-up), peak allocated and reserved device memory, and its output
against memfit's all-resident one (streamed rows must match it bit for bit) and against diffusers' (the same
dequantization arithmetic: max absolute difference, relative to the output's largest value).
"""

from __future__ import annotations

import gc
import shutil
import statistics
from pathlib import Path

KINDS = ("Q8_0", "Q4_0")
#: memfit's rows: (label, resident fraction, where the rest streams from, or "budget": planned from half the bytes)
MEMFIT_ROWS = (("memfit 100% resident", 1.0, "host"), ("memfit 25% resident", 0.25, "host"),
               ("memfit 0% resident", 0.0, "host"), ("memfit 25% resident, from the GGUF file", 0.25, "disk"),
               ("memfit, device budget half the stored bytes", 0.5, "budget"),  # or the smallest that works, if more
               ("memfit 25% resident, again after the others", 0.25, "host"))  # order effects show here
#: a streamed row's output may differ from the all-resident one's by this much, relative (none, on a correct path)
DIFFUSERS_TOLERANCE = 1e-2


def build(work: Path, config: dict) -> tuple[Path, dict[str, Path]]:
    """A pipeline folder whose transformer is ``config`` with no weights of its own, and one GGUF file per kind."""
    import torch
    from diffusers import FluxTransformer2DModel
    from quantized import random_gguf

    from memfit.testing import save_pipeline
    from memfit.testing.single_file import flux_bfl_state_dict

    folder = work / "flux-gguf"
    save_pipeline("flux", folder, seed=0)
    shutil.rmtree(folder / "transformer")
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    model.save_config(folder / "transformer")
    shapes = {key: tuple(value.shape) for key, value in flux_bfl_state_dict(model).items()}
    return folder, {kind: random_gguf(work / f"flux-width-{kind}.gguf", shapes, kind) for kind in KINDS}


def memfit_transformer(folder: Path, path: Path, dtype):
    from memfit.models.folder import ModelFolder
    from memfit.models.single_file import SingleFileModel

    model = SingleFileModel.with_components(ModelFolder.open(folder), {"transformer": path})
    return model.load_stage(["transformer"], dtype, in_file_dtype=[]).transformer


def diffusers_transformer(folder: Path, path: Path, dtype):
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    return FluxTransformer2DModel.from_single_file(
        str(path), config=str(folder), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype), torch_dtype=dtype).eval()


def _output(transformer, inputs) -> "torch.Tensor":  # noqa: F821
    import torch

    with torch.no_grad():
        return transformer(**inputs)[0].float().cpu()


def _compare(row: dict, output, reference, name: str) -> None:
    if reference is None:
        return
    difference = float((output - reference).abs().max())
    row[f"bitwise_to_{name}"] = difference == 0.0
    row[f"max_difference_to_{name}"] = difference
    row[f"relative_difference_to_{name}"] = difference / max(float(reference.abs().max()), 1e-30)


def _timed(row: dict, transformer, inputs, runtime, steps: int) -> None:
    from gpu_streaming import time_steps

    seconds, memory = time_steps(transformer, inputs, runtime, steps)
    row.update(seconds_per_forward=statistics.median(seconds), step_seconds=seconds, **memory)


def rows_for(kind: str, folder: Path, path: Path, runtime, *, size: int, text_tokens: int, steps: int, dtype,
             with_diffusers: bool, check) -> list[dict]:
    import memfit
    from gpu_streaming import Holder, flux_inputs, record_row, streamed_blocks

    rows, resident_output = [], None
    transformer = memfit_transformer(folder, path, dtype)
    inputs = flux_inputs(transformer, size, text_tokens, runtime.device, dtype)
    for label, resident, where in MEMFIT_ROWS:
        if check.left() < 20:
            rows.append({"type": kind, "run": label, "skipped": "deadline"})
            continue
        row = {"type": kind, "run": label}
        holder = Holder("transformer", transformer)
        planned = where == "budget"
        tiers, streamed, total = streamed_blocks(transformer, resident, "host" if planned else where)
        row.update(stored_bytes=total)
        try:
            if planned:
                row.update(device_budget=plan_within(holder, int(total * resident), runtime))
            else:
                memfit.optimize(holder, force_tiers=tiers, device=runtime)
            plan = holder._memfit_plan  # what the row ran with, for a row that goes wrong
            stage = plan.stages[0]
            row.update(streamed_bytes_per_forward=stage.streamed_from_host_bytes + stage.streamed_from_disk_bytes
                       if planned else streamed, plan_prefetch=plan.prefetch,
                       stream_window_bytes=stage.stream_window_bytes,
                       streamed_blocks=[p.block for p in stage.placements if p.where.value != "device"])
            try:
                output = _output(transformer, inputs)
                _timed(row, transformer, inputs, runtime, steps)
            finally:
                memfit.restore(holder)
            if resident_output is None:
                resident_output = output
            _compare(row, output, resident_output, "memfit_resident")
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        record_row(rows, row, runtime)
    del transformer
    gc.collect()
    for label in ("diffusers GGUF, all on the device", "diffusers GGUF, group offload (block_level, use_stream)"):
        offloaded = "group offload" in label
        if check.left() < 30 or not with_diffusers:
            rows.append({"type": kind, "run": label, "skipped": "deadline" if check.left() < 30 else
                         "needs CUDA and FLUX.1's widths (diffusers' single-file conversion assumes them)"})
            continue
        row = {"type": kind, "run": label}
        try:
            model = diffusers_transformer(folder, path, dtype)
            row.update(stored_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
            if offloaded:
                model.enable_group_offload(runtime.device, offload_type="block_level", num_blocks_per_group=1,
                                           use_stream=True)
                row.update(streamed_bytes_per_forward=row["stored_bytes"])
            else:
                model.to(runtime.device)
            output = _output(model, inputs)
            _timed(row, model, inputs, runtime, steps)
            _compare(row, output, resident_output, "memfit_resident")
            del model
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        gc.collect()
        record_row(rows, row, runtime)
    return rows


def plan_within(holder, budget: int, runtime) -> int:
    """memfit.optimize with a device budget of ``budget`` bytes, or the smallest that works where that is below it
    (a model of few blocks); returns the budget used."""
    import memfit
    from memfit.plan.budget import BudgetTooSmall

    try:
        memfit.optimize(holder, budget=memfit.Budget(device=budget), device=runtime, activation_bytes=0)
    except BudgetTooSmall as refused:
        budget = refused.needed
        memfit.optimize(holder, budget=memfit.Budget(device=budget), device=runtime, activation_bytes=0)
    return budget


def quantized(runtime, work: Path, config: dict, *, size: int, text_tokens: int, steps: int, dtype,
              with_diffusers: bool, check) -> dict:
    folder, files = build(work, config)
    rows = []
    for kind, path in files.items():
        rows += rows_for(kind, folder, path, runtime, size=size, text_tokens=text_tokens, steps=steps, dtype=dtype,
                         with_diffusers=with_diffusers, check=check)
    return {"rows": rows, "size": size, "text_tokens": text_tokens, "forwards_timed": steps,
            "file_bytes": {kind: path.stat().st_size for kind, path in files.items()}}


def failed(part: dict) -> bool:
    """A row that failed, a streamed memfit row that is not the all-resident one bit for bit, or diffusers' row far
    from memfit's."""
    for row in part.get("rows", []):
        if "error" in row:
            return True
        if row.get("run", "").startswith("memfit") and row.get("bitwise_to_memfit_resident") is False:
            return True
        if row.get("run", "").startswith("diffusers") and \
                (row.get("relative_difference_to_memfit_resident") or 0) > DIFFUSERS_TOLERANCE:
            return True
    return False
