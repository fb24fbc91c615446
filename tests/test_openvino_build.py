"""A cold OpenVINO build goes through an IR on disk, each step letting the one before go
(memfit.compile.backends.openvino): the torch weights are back in their files before the plugin compiles,
the plugin compiles from the IR read back memory-mapped, the exported blob goes to the store's file as it is
written, and the IR is not kept."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch

from memfit.compile.entry_points import WEIGHTS_ATTR, compile_components, uncompile

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")


class _RecordingCore:
    """The backend's ov.Core, with its imports recorded."""

    def __init__(self, core):
        self._core, self.imported = core, []

    def import_model(self, *args, **kwargs):
        self.imported.append(args)
        return self._core.import_model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._core, name)


def _pipeline(folder):
    import diffusers

    # bf16 from fp32 files: a build brings the torch weights in converted, and must let that copy go again
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16, safety_checker=None,
                                                             requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe):
    return pipe("a red circle", num_inference_steps=1, width=32, height=32, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


@needs_openvino
def test_a_cold_build_compiles_from_its_saved_ir_after_the_torch_weights_went_and_stores_only_the_blob(
        tiny_models, tmp_path, monkeypatch):
    from memfit.cache import CacheStore
    from memfit.compile.backends import openvino as backend

    store = CacheStore(tmp_path / "cache")
    new_core = backend._core.__wrapped__  # a Core of its own for each start, recording its imports
    reads, compiled_from = [], []
    real_read, real_compile = backend._read_ir, backend._compile_model

    def reading(xml):
        unet = pipe.unet
        params = list(unet.parameters())[1:]  # the first keeps its loaded form (module.dtype reads it)
        in_files = not vars(unet)[WEIGHTS_ATTR]._brought_in and all(p.dtype == torch.float32 for p in params)
        model, weights = real_read(xml)
        reads.append({"xml": xml, "existed": xml.is_file(), "torch_weights_in_files": in_files, "model": model,
                      "weights": weights})
        return model, weights

    monkeypatch.setattr(backend, "_read_ir", reading)
    monkeypatch.setattr(backend, "_compile_model",
                        lambda model, *args: compiled_from.append(model) or real_compile(model, *args))

    def cold_or_warm(loaded):
        core = _RecordingCore(new_core())
        monkeypatch.setattr(backend, "_core", lambda: core)
        compile_components(loaded, {"unet": "openvino"}, cache=store, fingerprints={"unet": "unet-weights"})
        images = _run(loaded)
        uncompile(loaded)
        return core, images

    pipe = _pipeline(tiny_models("sd"))
    cold, cold_images = cold_or_warm(pipe)
    assert len(reads) == 1, reads
    read = reads[0]
    assert read["xml"].name == "model.xml" and read["xml"].parent.name == backend.IR_DIR and read["existed"]
    assert read["torch_weights_in_files"], "the converted torch weights were still in memory when the compile began"
    # compiled from the IR read back, its weights a map of the saved .bin (not from the converted model)
    assert compiled_from == [read["model"]]
    assert Path(read["weights"].filename) == read["xml"].with_suffix(".bin")
    assert cold.imported == []  # the model built serves the cold run; the blob is for later starts
    assert not read["xml"].parent.exists()

    (entry,) = store.ls("compiled")
    stored = sorted(str(path.relative_to(entry.path)) for path in entry.path.rglob("*") if path.is_file())
    assert [name for name in stored if name.startswith("data/")] == ["data/model.blob", "data/outputs.json"]

    # A later start imports the blob written piece by piece, and computes what the built model did.
    pipe = _pipeline(tiny_models("sd"))
    warm, warm_images = cold_or_warm(pipe)
    assert len(reads) == 1 and len(warm.imported) == 1
    assert torch.allclose(warm_images, cold_images, atol=1e-5)


@needs_openvino
def test_the_exported_blob_written_piece_by_piece_is_the_one_export_model_makes():
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from memfit.compile.backends.openvino import _FileStream

    x = ops.parameter([1, 64], np.float32)
    hidden = x
    for seed in range(3):  # several constants: the binding writes each and seeks back to fill in the header
        weight = np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32)
        hidden = ops.relu(ops.matmul(hidden, ops.constant(weight), False, False))
    compiled = ov.Core().compile_model(ov.Model([hidden], [x]), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    whole = io.BytesIO()
    compiled.export_model(whole)
    pieces = io.BytesIO()  # a "file" whose writes are counted
    writes = []
    original_write = pieces.write
    pieces.write = lambda data: writes.append(len(data)) or original_write(data)
    stream = _FileStream(pieces)
    compiled.export_model(stream)
    assert pieces.getvalue() == whole.getvalue() and stream.getbuffer().nbytes == 0
    assert len(writes) > 3 and max(writes) < len(whole.getvalue())  # in pieces, never the whole model at once


@needs_openvino
def test_a_budget_too_small_for_a_cold_build_is_refused_before_it_naming_the_smallest_budget_that_builds(
        tiny_models, tmp_path, monkeypatch):
    import memfit
    from memfit.compile.backends import openvino as backend
    from memfit.plan import compiled as compiled_plan
    from memfit.plan.budget import BudgetTooSmall
    from memfit.run.memory import current_rss

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    # The tiny VAE's compiled model is a few MiB: a build said to need 2000x it is larger than the process's drift.
    monkeypatch.setattr(compiled_plan, "COMPILED_WHOLE_BUILD", 2000)
    built = []
    real_build = backend._build
    monkeypatch.setattr(backend, "_build", lambda *args: built.append(args) or real_build(*args))

    def run(budget: int):
        return memfit.generate("a red circle", model=tiny_models("sd"), steps=1, width=32, height=32,
                               backend={"vae": "openvino"}, budget=budget, progress=False)

    with pytest.raises(BudgetTooSmall):  # once first: what a first run imports and keeps is in the process
        run(current_rss() + 256 * 2**20)
    given = current_rss() + 256 * 2**20
    with pytest.raises(BudgetTooSmall, match="more while it is built") as refused:
        run(given)
    assert built == [] and refused.value.given == given and refused.value.needed > given
    assert f"--budget {-(-refused.value.needed // 2**20)}MiB or more" in str(refused.value)
    # The budget it names builds it (a little more: what this process holds drifts between the two runs).
    result = run(refused.value.needed + 32 * 2**20)
    assert len(built) == 1 and result.images
