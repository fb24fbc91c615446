"""A component served by a compiled model with its own weights (OpenVINO) does not also hold its torch
weights: they are memory-mapped from the model's safetensors (memfit.compile.weights), and budgets
count the compiled model instead (memfit.compile.entry_points.compiled_weight_bytes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.compile.backends import get_backend
from memfit.compile.entry_points import compile_components, compiled_weight_bytes, uncompile
from memfit.compile.precision import with_precision
from memfit.compile.weights import FileWeights
from memfit.errors import MemfitError

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")
MiB = 2**20


def _unet(folder: str, dtype: torch.dtype):
    import diffusers

    return diffusers.UNet2DConditionModel.from_pretrained(Path(folder) / "unet", torch_dtype=dtype)


def test_released_weights_are_the_files_and_come_back_equal(tiny_models):
    unet = _unet(tiny_models("sd"), torch.bfloat16)  # bf16 from fp32 files: the loaded weights are converted copies
    before = {name: p.detach().clone() for name, p in unet.named_parameters()}
    weights = FileWeights(unet, Path(tiny_models("sd")) / "unet")
    assert weights.release(), weights.kept_because
    first, *rest = list(unet.parameters())
    assert unet.dtype == torch.bfloat16 and first.dtype == torch.bfloat16
    assert rest and all(p.dtype == torch.float32 for p in rest)  # the file's tensors, not a bf16 copy in memory
    assert weights.released_bytes == sum(p.numel() * 2 for p in rest)
    with weights.held():
        assert all(torch.equal(p, before[name]) for name, p in unet.named_parameters())
    assert all(p.dtype == torch.float32 for p in list(unet.parameters())[1:])
    weights.restore()
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[name]) for name, p in unet.named_parameters())


def test_weights_changed_after_loading_stay_in_memory(tiny_models):
    unet = _unet(tiny_models("sd"), torch.float32)
    with torch.no_grad():
        unet.conv_out.weight.add_(1.0)
    weights = FileWeights(unet, Path(tiny_models("sd")) / "unet")
    assert not weights.release()
    assert "conv_out.weight differs" in weights.kept_because
    assert unet.conv_out.weight.dtype == torch.float32 and not weights.released


def test_a_module_loaded_in_its_files_dtype_runs_in_its_run_dtype(tiny_models):
    """Loaded in fp32 (its files' dtype) for a bf16 run: nothing is converted at load, yet every form the
    module takes (its anchor and buffers, held, restored, or kept in memory) is the plain bf16 load's."""
    plain = _unet(tiny_models("sd"), torch.bfloat16)
    expected = {name: p.detach() for name, p in plain.named_parameters()}
    unet = _unet(tiny_models("sd"), torch.float32)
    weights = FileWeights(unet, Path(tiny_models("sd")) / "unet", torch.bfloat16)
    assert weights.release(), weights.kept_because
    first, *rest = list(unet.parameters())
    assert unet.dtype == torch.bfloat16 and torch.equal(first, next(plain.parameters()))
    assert all(p.dtype == torch.float32 for p in rest)
    assert all(b.dtype == torch.bfloat16 for b in unet.buffers() if b.is_floating_point())
    assert weights.released_bytes == sum(p.numel() * 2 for p in rest)
    with weights.held():
        assert all(torch.equal(p, expected[name]) for name, p in unet.named_parameters())
    weights.restore()
    assert all(torch.equal(p, expected[name]) for name, p in unet.named_parameters())

    changed = _unet(tiny_models("sd"), torch.float32)
    with torch.no_grad():
        changed.conv_out.weight.add_(1.0)
    kept = FileWeights(changed, Path(tiny_models("sd")) / "unet", torch.bfloat16)
    assert not kept.release() and "conv_out.weight differs" in kept.kept_because
    assert all(p.dtype == torch.bfloat16 for p in changed.parameters())  # kept in memory, as it runs


def test_a_component_loaded_in_its_files_dtype_that_nothing_serves_from_files_runs_converted(tiny_models):
    """A backend that runs the torch weights themselves (eager) gets them in the run dtype, as a plain load."""
    import diffusers

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_models("sd"), safety_checker=None,
                                                             requires_safety_checker=False)  # fp32, as the files
    compile_components(pipe, {"unet": "eager"}, run_dtypes={"unet": torch.bfloat16, "vae": torch.bfloat16})
    assert all(p.dtype == torch.bfloat16 for p in pipe.unet.parameters())
    assert all(p.dtype == torch.bfloat16 for p in pipe.vae.parameters())  # not compiled at all
    assert all(p.dtype == torch.float32 for p in pipe.text_encoder.parameters())  # not named: as loaded
    uncompile(pipe)


@needs_openvino
def test_a_staged_compiled_run_loads_the_served_components_unconverted(tiny_models, tmp_path, monkeypatch):
    """A bf16 run of fp32 files with OpenVINO loads the components it compiles in fp32 (no conversion at
    load), and a warm start never converts them; a cold one builds the compiled models a load converted
    in bf16 would, so each path loads the other's from the store, and all draw the same image."""
    from memfit.models.folder import ModelFolder

    loaded_in_file_dtype = []
    load_stage = ModelFolder.load_stage

    def spy(self, names, *args, in_file_dtype=(), **kwargs):
        loaded_in_file_dtype.extend(in_file_dtype)
        return load_stage(self, names, *args, in_file_dtype=in_file_dtype, **kwargs)

    monkeypatch.setattr(ModelFolder, "load_stage", spy)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    brought_in = []  # components whose torch weights were read in their run form
    bring_in = FileWeights._bring_in

    def spy_bring_in(self):
        if self.released and not self._brought_in:
            brought_in.append(type(self.module).__name__)
        bring_in(self)

    monkeypatch.setattr(FileWeights, "_bring_in", spy_bring_in)

    def run(budget):
        result = memfit.generate("a red circle", model=tiny_models("sd"), steps=2, width=32, height=32, seed=3,
                                 dtype="bf16", backend={"unet": "openvino", "text_encoder": "openvino"},
                                 budget=budget, progress=False)
        records = [record for stage in result.report.stages for record in stage.compiled]
        return np.asarray(result.images[0]), {record["component"]: record["cold"] for record in records}

    unconverted_cold, cold = run("none")
    assert sorted(set(loaded_in_file_dtype)) == ["text_encoder", "unet"] and all(cold.values()), cold
    assert sorted(brought_in) == ["CLIPTextModel", "UNet2DConditionModel"]  # read by the builds
    brought_in.clear()
    unconverted_warm, warm = run("4GiB")
    assert not any(warm.values()) and not brought_in, (warm, brought_in)  # stored: never read
    loaded_in_file_dtype.clear()
    monkeypatch.setattr(ModelFolder, "convertible", lambda self, name, dtype: False)  # loaded converted
    converted_warm, warm = run("none")
    assert not loaded_in_file_dtype and not any(warm.values()), warm
    assert np.array_equal(unconverted_cold, unconverted_warm) and np.array_equal(unconverted_cold, converted_warm)


def test_precision_is_refused_where_the_backend_computes_in_the_dtype():
    with pytest.raises(MemfitError, match="--precision bf16 differs from --dtype fp32"):
        with_precision(None, "bf16", "fp32")
    with pytest.raises(MemfitError, match="for vae"):
        with_precision({"unet": "openvino", "vae": "eager"}, "bf16", torch.float32)
    with pytest.raises(MemfitError, match="fp64"):
        with_precision("openvino", "fp64", "fp32")
    assert with_precision("eager", "fp32", torch.float32) == "eager"
    configured = with_precision({"*": "openvino"}, "bf16", "fp32")["*"]
    assert configured.precision == "bf16" and configured.label == "openvino@bf16"
    assert get_backend("openvino").precision is None  # the registry's instance is untouched


def test_budget_counts_the_compiled_model_at_its_precision(tiny_models):
    import diffusers

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_models("sd"), safety_checker=None,
                                                             requires_safety_checker=False)
    params = sum(p.numel() for p in pipe.unet.parameters())
    costs = compiled_weight_bytes(pipe, ["unet", "vae"], {"unet": "openvino", "vae": "eager"}, torch.float32)
    if importlib.util.find_spec("openvino") is None:
        assert costs == {}
        return
    assert costs == {"unet": params * 4}  # eager uses the torch weights themselves: not counted twice
    bf16 = compiled_weight_bytes(pipe, ["unet"], with_precision("openvino", "bf16", "fp32"), torch.float32)
    assert bf16 == {"unet": params * 2}


@needs_openvino
def test_openvino_component_runs_from_mapped_weights_and_uncompiles_whole(tiny_models, tmp_path, monkeypatch):
    import diffusers

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_models("sd"), torch_dtype=torch.bfloat16,
                                                             safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    before = {name: p.detach().clone() for name, p in pipe.unet.named_parameters()}
    records = compile_components(pipe, {"unet": "openvino"})
    assert "memory-mapped" in records[0].weights, records[0].weights
    assert all(p.dtype == torch.float32 for p in list(pipe.unet.parameters())[1:])
    pipe("a red circle", num_inference_steps=2, width=32, height=32, generator=torch.Generator().manual_seed(0))
    assert records[0].status == "compiled" and records[0].cold
    assert all(p.dtype == torch.float32 for p in list(pipe.unet.parameters())[1:])  # still not in memory
    uncompile(pipe)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[name]) for name, p in pipe.unet.named_parameters())


# --- under a real memory cap ----------------------------------------------------------------------

RUN = """
import sys
from memfit.cli.app import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@needs_openvino
def test_warm_openvino_run_fits_where_torch_weights_beside_the_compiled_model_do_not(tmp_path):
    """A bf16 run of fp32 files: the loaded UNet is a bf16 copy in memory, and OpenVINO's compiled UNet
    another bf16 copy. Capped at the baseline plus 1.5 of them (plus what the run itself needs beyond its
    weights, measured uncapped), the run completes only if the torch copy goes before the compiled one
    comes; the image equals the uncapped run's."""
    import os

    import numpy as np
    from PIL import Image

    from memfit.testing import save_pipeline
    from memfit.testing.cgroup import cgroup_unavailable_reason, evict_page_cache, run_capped

    reason = cgroup_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot cap memory here: {reason}")
    model = str(save_pipeline("sd", tmp_path / "sd", scale=24, text_layers=4))
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(tmp_path / "cache")}

    def ours(name, cap):
        command = [sys.executable, "-c", RUN, "generate", "--model", model, "--prompt", "a red circle", "--steps", "1",
                   "--guidance", "2", "--width", "32", "--height", "32", "--dtype", "bf16", "--budget", "none",
                   "--backend", "unet=openvino", "--quiet", "--out", str(tmp_path / f"{name}.png"),
                   "--report", str(tmp_path / f"{name}.json")]
        evict_page_cache(model)
        return run_capped(command, cap, timeout=900, env=env)

    assert ours("cold", None).completed  # fills the store
    env["MEMFIT_CACHE"] = "require"  # from here on a miss is an error, not a build
    warm = ours("uncapped", None)
    assert warm.completed, warm.stderr[-500:]
    baseline = run_capped([sys.executable, "-c", "import torch, diffusers, transformers, openvino, memfit.cli.app"],
                          None, timeout=600)
    unet_bf16 = sum(f.stat().st_size for f in (Path(model) / "unet").glob("*.safetensors")) // 2
    assert unet_bf16 > 200 * MiB
    cap = baseline.max_usage_bytes + unet_bf16 * 3 // 2 + 100 * MiB
    capped = ours("capped", cap)
    assert capped.completed, f"did not fit in {cap / MiB:.0f} MiB: {capped.stderr[-500:]}"
    notes = json.loads((tmp_path / "capped.json").read_text())["notes"]
    assert any("memory-mapped" in note and "loaded from memfit's store" in note for note in notes), notes
    capped_image, uncapped_image = Image.open(tmp_path / "capped.png"), Image.open(tmp_path / "uncapped.png")
    assert np.array_equal(np.asarray(capped_image), np.asarray(uncapped_image))


def test_compiled_models_that_do_not_fit_are_refused_or_run_eagerly():
    from types import SimpleNamespace

    from memfit.plan.budget import Budget
    from memfit.run.runner import StageDoesNotFit, _fit_compiled

    compiled = {"unet": 600 * MiB, "text_encoder": 100 * MiB}
    runner = SimpleNamespace(fallback=None, report=SimpleNamespace(notes=[]))
    kept, backend = _fit_compiled(Budget(device=1000 * MiB), 300 * MiB, compiled, "denoise", "openvino", runner)
    assert kept == compiled and backend == "openvino"  # they fit: nothing changes
    with pytest.raises(StageDoesNotFit, match="need 1000.00 MiB.*--budget 1000MiB"):
        _fit_compiled(Budget(device=900 * MiB), 300 * MiB, compiled, "denoise", "openvino", runner)
    runner.fallback = "eager"
    kept, backend = _fit_compiled(Budget(device=900 * MiB), 300 * MiB, compiled, "denoise", "openvino", runner)
    assert kept == {"text_encoder": 100 * MiB} and backend == {"*": "openvino", "unet": None}
    assert "unet run eagerly" in runner.report.notes[-1]


def test_plan_says_what_a_precision_changes(capsys):
    from memfit.cli.app import main

    assert main(["plan", "--arch", "sd15", "--budget", "4GiB", "--precision", "bf16"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("precision bf16 with fp32 weights") and "8 mantissa bits instead of 24" in line


def test_the_precision_is_recorded_also_for_a_class_without_adapter(tiny_models):
    """A pipeline memfit runs through its own __call__ (no adapter) records the compute precision too."""
    result = memfit.generate("a red circle", model=tiny_models("sd_pag"), steps=1, width=32, height=32,
                             backend="eager", precision="fp32", progress=False)
    assert result.report.stages[0].stage == "pipeline"
    assert result.metadata["precision"] == "fp32"
