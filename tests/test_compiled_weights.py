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
from memfit.compile.entry_points import compile_components, compiled_in_store, compiled_weight_bytes, uncompile
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


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_what_stays_in_memory_of_a_released_module_is_no_view_of_the_loaders_map(tiny_models):
    """A module loaded in its files' dtype may be views of the loader's map of the whole file: the first parameter
    and the buffers it keeps in memory are copies, so that map (and every page read from it) can go."""
    file = Path(tiny_models("sd")) / "unet" / "diffusion_pytorch_model.safetensors"
    unet = _unet(tiny_models("sd"), torch.float32)
    weights = FileWeights(unet, file.parent)
    assert weights.release(), weights.kept_because
    in_memory = [next(unet.parameters()), *unet.buffers()]
    ranges = _mapped_ranges(file.resolve()) + _mapped_ranges(file)
    assert all(not start <= tensor.data_ptr() < end for tensor in in_memory for start, end in ranges)


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


def test_budget_counts_the_compiled_model_at_its_precision(tiny_models, monkeypatch):
    import diffusers

    from memfit.compile.backends import openvino

    # a CPU that computes bf16 (one that cannot holds f32: the test below)
    monkeypatch.setattr(openvino, "_capabilities", lambda device: frozenset({"FP32", "BF16"}))

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
    assert "memory-mapped" in records[0].weights and records[0].weights_mapped, records[0].weights
    assert all(p.dtype == torch.float32 for p in list(pipe.unet.parameters())[1:])
    pipe("a red circle", num_inference_steps=2, width=32, height=32, generator=torch.Generator().manual_seed(0))
    assert records[0].status == "compiled" and records[0].cold
    assert all(p.dtype == torch.float32 for p in list(pipe.unet.parameters())[1:])  # still not in memory
    uncompile(pipe)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[name]) for name, p in pipe.unet.named_parameters())


@pytest.mark.parametrize("capabilities, requested, held", [
    ({"FP32", "BF16"}, "bf16", "bf16"),
    ({"FP32", "INT8"}, "bf16", "fp32"),  # an AVX2 CPU: OpenVINO computes (and holds weights) in f32
    ({"FP32", "INT8"}, "fp32", "fp32"),
    (set(), "bf16", "bf16"),  # OpenVINO cannot say: the hint is taken as given
])
def test_a_budget_counts_an_openvino_model_at_the_precision_its_device_can_compute_in(
        monkeypatch, capabilities, requested, held):
    from memfit.compile.backends import openvino

    monkeypatch.setattr(openvino, "_capabilities", lambda device: frozenset(capabilities))
    assert get_backend("openvino").held_precision(requested) == held
    assert get_backend("openvino").configured(requested).held_precision("fp32") == held


@needs_openvino
def test_the_store_says_which_components_it_holds_compiled(tiny_models, tmp_path):
    """What a budget reads before any compile: a component's first call imports a stored model, or builds
    one (which peaks at several times its size)."""
    import diffusers

    from memfit.cache import CacheStore

    store = CacheStore(tmp_path / "cache")
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_models("sd"), safety_checker=None,
                                                             requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    fingerprints = {"unet": "unet-weights", "vae": "vae-weights"}
    openvino = {"unet": get_backend("openvino"), "vae": get_backend("openvino")}
    assert compiled_in_store(fingerprints, openvino, cache=store) == set()
    compile_components(pipe, {"vae": "openvino"}, cache=store, fingerprints=fingerprints)
    pipe("a red circle", num_inference_steps=1, width=32, height=32, generator=torch.Generator().manual_seed(0))
    uncompile(pipe)
    assert compiled_in_store(fingerprints, openvino, cache=store) == {"vae"}
    assert compiled_in_store({"vae": "other weights"}, openvino, cache=store) == set()
    assert compiled_in_store(fingerprints, {"vae": get_backend("onnxruntime")}, cache=store) == set()
    assert compiled_in_store(fingerprints, openvino, cache=CacheStore(tmp_path / "cache", mode="off")) == set()


@needs_openvino
@pytest.mark.parametrize("budget, pressed, freed_first, freed_later", [
    ("8GiB", False, ["unet"], []),  # the kept UNet's, before the decode is planned; then all fit
    ("8GiB", True, ["unet"], ["unet", "vae"]),  # no stage fits beside the kept buffers: they go each time
    ("none", False, [], []),
])
def test_a_session_keeps_its_compiled_models_buffers_while_the_budget_has_room_for_them(
        tiny_models, tmp_path, monkeypatch, budget, pressed, freed_first, freed_later):
    """Between images a Session keeps its compiled models loaded with their intermediate buffers, so the
    next image need not allocate them again. Under a budget they go before a stage is planned (its plan
    counts only the kept weights) and before a warm stage that could not grow beside them as much as it
    did before; the images are the same either way."""
    import memfit.run.session as session_module
    from memfit.compile.entry_points import ENTRIES_ATTR, release_buffers
    from memfit.run.session import Session

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    freed = []

    def counting(pipe):
        for name, module in pipe.components.items():
            for entry in vars(module).get(ENTRIES_ATTR, {}).values() if isinstance(module, torch.nn.Module) else ():
                for run, _ in entry.compiled.values():
                    release = run.release_buffers
                    run.release_buffers = lambda release=release, name=name: (freed.append(name), release())
        release_buffers(pipe)

    monkeypatch.setattr(session_module, "release_buffers", counting)
    if pressed:  # as if every stage had grown by the whole budget while it ran
        noted = session_module.WarmPool.note_growth
        monkeypatch.setattr(session_module.WarmPool, "note_growth",
                            lambda pool, stage, grew_by, loaded: noted(pool, stage, 8 << 30, loaded=loaded))
    session = Session(tiny_models("sd"), budget=budget, backend={"unet": "openvino", "vae": "openvino"})
    first = session.generate("a red circle", seed=1, steps=2, width=32, height=32)
    assert freed == freed_first
    for _ in range(2):
        freed.clear()
        later = session.generate("a red circle", seed=1, steps=2, width=32, height=32)
        assert sorted(set(freed)) == freed_later
        assert np.array_equal(np.asarray(first.images[0]), np.asarray(later.images[0]))
    assert session.warm_state()["warm"]
    session.close()


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
    # The compiled UNet and half its torch weights fit, both whole do not. A CPU without bf16 in hardware
    # holds the compiled model in f32: twice the bf16 bytes.
    compiled = unet_bf16 * (2 if get_backend("openvino").held_precision("bf16") == "fp32" else 1)
    cap = baseline.max_usage_bytes + compiled + unet_bf16 // 2 + 100 * MiB
    capped = ours("capped", cap)
    assert capped.completed, f"did not fit in {cap / MiB:.0f} MiB: {capped.stderr[-500:]}"
    notes = json.loads((tmp_path / "capped.json").read_text())["notes"]
    assert any("memory-mapped" in note and "loaded from memfit's store" in note for note in notes), notes
    capped_image, uncapped_image = Image.open(tmp_path / "capped.png"), Image.open(tmp_path / "uncapped.png")
    assert np.array_equal(np.asarray(capped_image), np.asarray(uncapped_image))


@needs_openvino
def test_a_compiled_unet_too_large_for_the_budget_runs_its_resident_blocks_compiled(tiny_models, streamed_plans):
    """Under a budget below the compiled UNet, the blocks the plan keeps resident run as OpenVINO models of
    their own (their torch weights memory-mapped) and the rest stream eagerly: the image is the uncapped
    compiled run's (fp32: within OpenVINO's tolerance)."""
    import memfit.run.fit as fit
    from memfit.compile.entry_points import ENTRIES_ATTR, WEIGHTS_ATTR
    from memfit.plan import activations

    model = tiny_models("sd")
    settings = dict(model=model, steps=2, width=32, height=32, seed=0, guidance=3.0, progress=False,
                    backend={"unet": "openvino"})
    whole = memfit.generate("a red circle", budget="none", **settings)
    assert [r["component"] for s in whole.report.stages for r in (s.compiled or [])] == ["unet"]

    from safetensors import safe_open

    unet_bytes = 0  # what the compiled UNet holds: every parameter in fp32
    for file in (Path(model) / "unet").glob("*.safetensors"):
        with safe_open(file, "pt") as weights:
            unet_bytes += sum(int(np.prod(weights.get_slice(key).get_shape())) * 4 for key in weights.keys())
    seen = []
    original = fit.compile_blocks

    def recording(module, component, paths, *args, **kwargs):
        records = original(module, component, paths, *args, **kwargs)
        seen.append([module.get_submodule(path) for path in paths])
        return records

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fit, "compile_blocks", recording)
        # The budget is about the UNet's weights: no room for the denoising loop's heap beside them as well.
        patch.setattr(activations, "HEAP_SLACK_CEILING", 0)
        split = memfit.generate("a red circle", budget=unet_bytes - 1, **settings)  # whole, it is 1 byte over
    denoise = next(plan.stages[0] for plan in streamed_plans if plan.stages[0].name == "denoise")
    assert denoise.from_disk and denoise.resident  # the plan streams some blocks and keeps others
    records = [r for s in split.report.stages for r in (s.compiled or [])]
    assert records and all(r["component"].startswith("unet/") and r["status"] == "compiled" for r in records)
    assert len(records) == len(seen[0])
    for block in seen[0]:  # served by its compiled model, its torch weights are the file's
        assert vars(block)[ENTRIES_ATTR] and vars(block)[WEIGHTS_ATTR].released
    streamed = [r for r in records if any(r["component"] == key or r["component"].startswith(key + ".")
                                          for key in denoise.from_disk)]
    assert not streamed  # a block the plan streams runs eagerly
    assert any("run compiled with openvino, each a model of its own" in note for note in split.report.notes)
    difference = np.abs(np.asarray(split.images[0], dtype=int) - np.asarray(whole.images[0], dtype=int))
    assert difference.max() <= 1, difference.max()


@needs_openvino  # the quick tier runs after `make demo`'s set-up too, which installs no backend
def test_a_budget_with_no_room_for_any_compiled_block_runs_the_unet_eagerly_and_says_so(tiny_models, streamed_plans):
    model = tiny_models("sd")
    unet_bytes = sum(f.stat().st_size for f in (Path(model) / "unet").glob("*.safetensors"))
    result = memfit.generate("a red circle", model=model, steps=1, width=32, height=32, seed=0, progress=False,
                             backend={"unet": "openvino"}, budget=unet_bytes // 2)
    assert not [r for s in result.report.stages for r in (s.compiled or []) if r["component"].startswith("unet")]
    assert any("no block of it fits compiled" in note and "unet runs eagerly as planned" in note
               for note in result.report.notes), result.report.notes


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
