"""Backends: the registry, and each backend's contract on a tiny conv model.

Contract (memfit/backends/base.py): plain torch.Tensor outputs equal to eager within the backend's
tolerance on every call, torch's global settings unchanged, errors that name what to do.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from torch import nn

import memfit.compile.backends as backends
from memfit.compile.backends import (
    Backend, CompileRequest, get_backend, list_backends, plain_outputs, snapshot_torch_settings,
)
from memfit.compile.backends import registry
from memfit.cache import CacheStore
from memfit.errors import MemfitError

# The folder holding this memfit package (src/), so that subprocesses import this copy, not an installed one.
SRC_DIR = str(Path(backends.__file__).resolve().parents[3])


def tiny_conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1)
    ).eval()


@pytest.fixture(scope="module")
def model_and_inputs():
    model = tiny_conv_model()
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    return model, (x,), expected


def skip_unless_available(name: str) -> None:
    ok, reason = get_backend(name).available()
    if not ok:
        pytest.skip(reason)


def assert_plain_and_close(output, expected, tolerance: float) -> None:
    assert type(output) is torch.Tensor, f"backend returned {type(output).__name__}"
    assert output.shape == expected.shape and output.dtype == expected.dtype
    difference = (output - expected).abs().max().item()
    assert difference <= tolerance, f"max |difference| {difference} > {tolerance}"


# -- registry ------------------------------------------------------------------------------------


def test_builtin_backends_are_listed_in_order():
    assert list_backends()[:4] == ["eager", "inductor", "openvino", "onnxruntime"]


def test_unknown_backend_error_lists_the_valid_names():
    with pytest.raises(MemfitError) as info:
        get_backend("tensorrt-but-misspelled")
    message = str(info.value)
    assert "tensorrt-but-misspelled" in message
    for name in ("eager", "inductor", "openvino", "onnxruntime"):
        assert name in message


def test_a_backend_instance_passes_through_and_options_are_checked():
    eager = get_backend("eager")
    assert get_backend(eager) is eager
    with pytest.raises(MemfitError, match="valid options: config, device"):
        get_backend("openvino").resolve_options({"precision": "f32"})
    with pytest.raises(MemfitError, match="name or a memfit Backend"):
        get_backend(42)


def test_availability_unpacks_as_ok_and_reason():
    for name, (ok, reason) in backends.available_backends().items():
        assert isinstance(ok, bool) and isinstance(reason, str) and reason, name
    assert get_backend("eager").available() == (True, "eager is available")


def test_missing_dependency_is_reported_with_the_install_command(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real_find_spec(name, *a)
    )
    assert get_backend("openvino").available() == (
        False,
        "openvino is not installed: pip install memfit[openvino]",
    )
    with pytest.raises(MemfitError, match=r"pip install memfit\[openvino\]"):
        get_backend("openvino").compile(CompileRequest(tiny_conv_model(), (torch.randn(1, 4, 8, 8),)))


def test_register_backend_at_run_time():
    class NullBackend(Backend):
        name = "null"

        def compile(self, request):
            return request.fn

    registry.register_backend("null", NullBackend)
    try:
        assert isinstance(get_backend("null"), NullBackend) and "null" in list_backends()
        with pytest.raises(MemfitError, match="already exists"):
            registry.register_backend("null", NullBackend)
        with pytest.raises(MemfitError, match="already exists"):
            registry.register_backend("eager", NullBackend)
    finally:
        registry.unregister_backend("null")
    assert "null" not in list_backends()


def test_a_backend_written_for_the_earlier_compile_signature_is_refused_when_chosen():
    class EarlierStyle(Backend):
        name = "earlier-style"

        def compile(self, fn, example_inputs, options=None, cache=None, weights_fingerprint=None):
            return fn

    registry.register_backend("earlier-style", EarlierStyle)
    try:
        with pytest.raises(MemfitError, match=r"'earlier-style' .*EarlierStyle\) defines compile\(fn, example_inputs"
                                              r".*one memfit.compile.backends.CompileRequest"):
            get_backend("earlier-style")
        assert backends.available_backends()["earlier-style"].ok is False
        with pytest.raises(MemfitError, match="update that backend's compile method"):
            get_backend(EarlierStyle())
    finally:
        registry.unregister_backend("earlier-style")


def test_out_of_tree_backend_through_entry_points(monkeypatch):
    plugin = metadata.EntryPoint(
        name="plugin", value="memfit.compile.backends.eager:EagerBackend", group=registry.ENTRY_POINT_GROUP
    )
    broken = metadata.EntryPoint(name="broken", value="no_such_module_xyz:Backend", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        registry.metadata,
        "entry_points",
        lambda group: [plugin, broken] if group == registry.ENTRY_POINT_GROUP else [],
    )
    assert "plugin" in list_backends() and "broken" in list_backends()
    assert type(get_backend("plugin")).__name__ == "EagerBackend"
    with pytest.raises(MemfitError, match="'broken'.*failed to import"):
        get_backend("broken")
    assert backends.available_backends()["broken"].ok is False


def test_the_cli_help_lists_every_registered_backend(monkeypatch, capsys):
    from memfit.cli.app import build_parser

    plugin = metadata.EntryPoint(
        name="plugin", value="memfit.compile.backends.eager:EagerBackend", group=registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda group: [plugin] if group == registry.ENTRY_POINT_GROUP else [])
    registry.register_backend("null", Backend)  # listed by name: never built here
    try:
        names = list_backends()
        assert {"eager", "inductor", "openvino", "onnxruntime", "plugin", "null"} <= set(names)
        for command in ("generate", "serve", "batch"):
            with pytest.raises(SystemExit):
                build_parser().parse_args([command, "--help"])
            assert f"--backend BACKEND compile with a backend: NAME ({', '.join(names)})" in " ".join(
                capsys.readouterr().out.split())
    finally:
        registry.unregister_backend("null")


@pytest.mark.slow
def test_importing_backends_and_listing_them_stays_lean():
    code = (
        "import sys, memfit.compile.backends as b; b.list_backends(); b.get_backend('eager'); "
        "b.available_backends(); "
        "print(sorted(m for m in ('openvino', 'onnxruntime', 'onnx') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=SRC_DIR)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- plain outputs -------------------------------------------------------------------------------


def test_plain_outputs_strips_subclasses_everywhere():
    param = nn.Parameter(torch.ones(2))
    result = plain_outputs({"a": param, "b": [param, (param, 3)]})
    assert type(result["a"]) is torch.Tensor and type(result["b"][1][0]) is torch.Tensor
    assert result["b"][1][1] == 3
    assert torch.equal(result["a"], torch.ones(2))


def test_plain_outputs_refuses_tensors_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2)
    with pytest.raises(MemfitError, match="without data"):
        plain_outputs((torch.ones(1), fake))
    with pytest.raises(MemfitError, match="without data"):
        plain_outputs(torch.empty(2, device="meta"))


# -- eager and inductor --------------------------------------------------------------------------


def test_eager_is_exact_plain_and_leaves_settings_alone(model_and_inputs):
    model, inputs, expected = model_and_inputs
    before = snapshot_torch_settings()
    run = get_backend("eager").compile(CompileRequest(model, inputs))
    with torch.no_grad():
        out = run(*inputs)
    assert_plain_and_close(out, expected, tolerance=0.0)
    assert snapshot_torch_settings() == before


@pytest.fixture(scope="module")
def inductor_run(model_and_inputs):
    model, inputs, _ = model_and_inputs
    if not get_backend("inductor").available().ok:
        pytest.skip(get_backend("inductor").available().reason)
    before = snapshot_torch_settings()
    run = get_backend("inductor").compile(CompileRequest(model, inputs))  # the slow part: compile once per module
    return run, before


@pytest.mark.slow
def test_inductor_matches_eager_with_plain_tensors(model_and_inputs, inductor_run):
    _, inputs, expected = model_and_inputs
    run, _ = inductor_run
    with torch.no_grad():
        first = run(*inputs)
        second = run(*inputs)
    tolerance = get_backend("inductor").float32_tolerance
    assert_plain_and_close(first, expected, tolerance)
    assert torch.equal(first, second)


@pytest.mark.slow
def test_inductor_leaves_global_settings_unchanged(model_and_inputs, inductor_run):
    _, inputs, _ = model_and_inputs
    run, before = inductor_run
    with torch.no_grad():
        run(*inputs)
    assert snapshot_torch_settings() == before


_INDUCTOR_START = """
import json
import torch
from torch._dynamo.utils import counters
from memfit.compile.backends import CompileRequest, get_backend
from memfit.cache import open_store

model = tiny_conv_model()
x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
request = CompileRequest(model, (x,), cache=open_store(), weights_fingerprint="tiny-conv-seed0")
run = get_backend("inductor").compile(request)
with torch.no_grad():
    expected = model(x)
    outputs = [run(x) for _ in range(3)]
print(json.dumps({
    "types": sorted({type(o).__name__ for o in outputs}),
    "numpy_shapes": sorted({o.numpy().shape for o in outputs}),
    "max_difference": max((o - expected).abs().max().item() for o in outputs),
    "runs_equal": all(torch.equal(o, outputs[0]) for o in outputs),
    "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
    "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
}))
"""


def _inductor_start(env: dict) -> dict:
    code = "import torch\nfrom torch import nn\n" + inspect.getsource(tiny_conv_model) + _INDUCTOR_START
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_inductor_artifacts_are_stored_then_loaded_in_a_fresh_process(tmp_path):
    """The second start has an empty inductor cache directory and MEMFIT_CACHE=require: its
    AOTAutograd and FX graph cache hits can only come from the entry in memfit's store, and so can
    its C++ kernels: it builds none (every library in its inductor directory is one the store held)."""
    if not get_backend("inductor").available().ok:
        pytest.skip(get_backend("inductor").available().reason)
    env = dict(os.environ, PYTHONPATH=SRC_DIR, MEMFIT_CACHE_DIR=str(tmp_path / "store"))
    cold = _inductor_start(dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cold")))
    warm = _inductor_start(dict(env, MEMFIT_CACHE="require", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-warm")))

    assert cold["fxgraph_cache_miss"] == 1  # the cold start really compiled
    assert warm["fxgraph_cache_miss"] == 0 and warm["autograd_cache_miss"] == 0 and warm["fxgraph_cache_hit"] >= 1
    for start in (cold, warm):
        assert start["types"] == ["Tensor"] and start["numpy_shapes"] == [[1, 4, 8, 8]]
        assert start["max_difference"] <= get_backend("inductor").float32_tolerance and start["runs_equal"]
    [entry] = CacheStore(tmp_path / "store").ls()
    assert entry.parts["backend"] == "inductor" and entry.meta["artifacts"]["inductor"] >= 1

    def libraries(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.so")}

    stored = libraries(entry.path / "data" / "kernels")
    assert stored and entry.meta["kernels"] >= len(stored)
    assert libraries(tmp_path / "inductor-warm") == stored  # put back where inductor looks; nothing built


def test_inductor_under_cache_require_raises_instead_of_compiling(model_and_inputs, tmp_path, monkeypatch):
    model, inputs, _ = model_and_inputs
    if not get_backend("inductor").available().ok:
        pytest.skip(get_backend("inductor").available().reason)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: lambda *args: pytest.fail("compiled under require"))
    with pytest.raises(MemfitError, match="MEMFIT_CACHE=require"):
        get_backend("inductor").compile(CompileRequest(
            model, inputs, cache=CacheStore(tmp_path, mode="require"), weights_fingerprint="tiny-conv-seed0"
        ))


def test_settings_guard_restores_a_changed_setting():
    """The guard itself must work, or the 'unchanged' tests above prove nothing."""
    before = snapshot_torch_settings()
    with backends.preserved_torch_settings():
        torch._dynamo.config.cache_size_limit += 1
        torch.set_default_dtype(torch.float64)
        assert snapshot_torch_settings() != before
    assert snapshot_torch_settings() == before


# -- openvino ------------------------------------------------------------------------------------


def test_openvino_matches_eager_every_run_and_contains_its_global_setting(model_and_inputs):
    skip_unless_available("openvino")
    model, inputs, expected = model_and_inputs
    before = snapshot_torch_settings()
    inline_before = torch._dynamo.config.inline_inbuilt_nn_modules
    run = get_backend("openvino").compile(CompileRequest(model, inputs))  # imports openvino.torch on first use
    assert torch._dynamo.config.inline_inbuilt_nn_modules == inline_before
    with torch.no_grad():
        outputs = [run(*inputs) for _ in range(3)]  # failure 5 struck on the second generation
    tolerance = get_backend("openvino").float32_tolerance  # fp32 pinned: bf16 would be ~1e-2 off
    for out in outputs:
        assert_plain_and_close(out, expected, tolerance)
        out.numpy()  # what failed with tensor subclasses
    assert torch.equal(outputs[0], outputs[2])
    assert snapshot_torch_settings() == before


@pytest.mark.parametrize("own_cache", [{"model_caching": True}, {"CACHE_DIR": "/tmp/ov-cache"}])
def test_openvino_refuses_its_own_caching(model_and_inputs, own_cache):
    skip_unless_available("openvino")
    model, inputs, _ = model_and_inputs
    with pytest.raises(MemfitError, match=f"{next(iter(own_cache))} is not supported"):
        get_backend("openvino").compile(CompileRequest(model, inputs, options={"config": own_cache}))


# -- openvino, stored in memfit's cache -------------------------------------------------------------
# The fresh-process start (MEMFIT_CACHE=require) is in tests/test_compile.py, on a tiny pipeline.


@pytest.fixture
def openvino_backend_module():
    skip_unless_available("openvino")
    from memfit.compile.backends import openvino as openvino_backend

    return openvino_backend


def test_openvino_stores_its_compiled_model_and_loads_it_without_converting(
    model_and_inputs, tmp_path, monkeypatch, openvino_backend_module
):
    model, inputs, expected = model_and_inputs
    store = CacheStore(tmp_path, mode="on")
    backend = get_backend("openvino")
    run = backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    first = run(*inputs)
    assert_plain_and_close(first, expected, backend.float32_tolerance)
    [entry] = store.ls()
    assert entry.parts["backend"] == "openvino" and entry.parts["weights"] == "tiny-conv-seed0"
    assert entry.parts["backend_options"]["config"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert sorted(p.name for p in (entry.path / "data").iterdir()) == ["model.blob", "outputs.json"]

    monkeypatch.setattr(openvino_backend_module, "_convert", lambda *a, **k: pytest.fail("converted again"))
    again = backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    # fp32 stays fp32 after an import too (the CPU plugin would pick bf16 without the hint).
    assert str(again.compiled_model.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
    assert torch.equal(again(*inputs), first)
    assert store.verify() == [] and len(store.ls()) == 1


@pytest.mark.slow
def test_openvino_entry_with_a_flipped_byte_is_rebuilt_never_loaded(
    model_and_inputs, tmp_path, monkeypatch, openvino_backend_module
):
    from memfit.cache import CacheCorruptionWarning

    model, inputs, expected = model_and_inputs
    store = CacheStore(tmp_path, mode="on")
    backend = get_backend("openvino")
    backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    [entry] = store.ls()
    blob = entry.path / "data" / openvino_backend_module.MODEL_FILE
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # same size: only the checksum can tell
    blob.write_bytes(bytes(damaged))

    real_load = openvino_backend_module._load_entry

    def load_checked(entry_data, *args):
        assert store.verify() == [], "OpenVINO was handed an entry that fails its checksums"
        return real_load(entry_data, *args)

    monkeypatch.setattr(openvino_backend_module, "_load_entry", load_checked)
    with pytest.warns(CacheCorruptionWarning, match="model.blob fails its sha256"):
        run = backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    assert_plain_and_close(run(*inputs), expected, backend.float32_tolerance)
    assert blob.read_bytes() != bytes(damaged) and store.verify() == []


def test_openvino_under_cache_require_raises_instead_of_compiling(
    model_and_inputs, tmp_path, monkeypatch, openvino_backend_module
):
    model, inputs, _ = model_and_inputs
    monkeypatch.setattr(openvino_backend_module, "_convert", lambda *a, **k: pytest.fail("converted under require"))
    with pytest.raises(MemfitError, match="MEMFIT_CACHE=require"):
        get_backend("openvino").compile(CompileRequest(
            model, inputs, cache=CacheStore(tmp_path, mode="require"), weights_fingerprint="tiny-conv-seed0"
        ))


def test_openvino_with_the_cache_off_compiles_in_memory_and_writes_nothing(model_and_inputs, tmp_path):
    skip_unless_available("openvino")
    model, inputs, expected = model_and_inputs
    backend = get_backend("openvino")
    store = CacheStore(tmp_path, mode="off")
    run = backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    assert_plain_and_close(run(*inputs), expected, backend.float32_tolerance)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(MemfitError, match="compile again"):
        run(torch.randn(2, 4, 8, 8))


class ReturnsATensorTwice(nn.Module):
    """Like a diffusers down block: the last hidden state is returned, and again among the residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = tiny_conv_model(), nn.Conv2d(4, 4, 3, stride=2, padding=1)

    def forward(self, x):
        residual = self.first(x)
        hidden = self.last(residual)
        return hidden, (residual, hidden)


def test_openvino_returns_a_tensor_the_module_returns_twice_from_one_output(tmp_path):
    skip_unless_available("openvino")
    model = ReturnsATensorTwice().eval()
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, (residual, again) = model(x)
    store = CacheStore(tmp_path, mode="on")
    backend = get_backend("openvino")
    for _ in range(2):  # compiled, then loaded from the store with its stored layout
        run = backend.compile(CompileRequest(model, (x,), cache=store, weights_fingerprint="twice-seed0"))
        assert len(run.compiled_model.outputs) == 2
        out_hidden, (out_residual, out_again) = run(x)
        assert out_again is out_hidden
        assert_plain_and_close(out_hidden, hidden, backend.float32_tolerance)
        assert_plain_and_close(out_residual, residual, backend.float32_tolerance)
    assert len(store.ls()) == 1


# -- onnxruntime ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_onnxruntime_matches_eager_and_is_served_from_the_cache(model_and_inputs, tmp_path, monkeypatch):
    skip_unless_available("onnxruntime")
    from memfit.compile.backends import onnxruntime as ort_backend

    model, inputs, expected = model_and_inputs
    store = CacheStore(tmp_path, mode="on")
    before = snapshot_torch_settings()
    backend = get_backend("onnxruntime")
    run = backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    with torch.no_grad():
        out = run(*inputs)
    assert_plain_and_close(out, expected, backend.float32_tolerance)
    assert snapshot_torch_settings() == before
    [entry] = store.ls()
    assert entry.parts["backend"] == "onnxruntime" and entry.parts["weights"] == "tiny-conv-seed0"

    # Second start: loads the stored graph, never exports (a shared component is exported once).
    monkeypatch.setattr(ort_backend, "_export", lambda *a, **k: pytest.fail("exported again"))
    again = backend.compile(CompileRequest(model, inputs, cache=store, weights_fingerprint="tiny-conv-seed0"))
    assert torch.equal(again(*inputs), out)
    assert store.verify() == []


@pytest.mark.slow
def test_onnxruntime_says_shapes_are_static(model_and_inputs):
    skip_unless_available("onnxruntime")
    model, inputs, _ = model_and_inputs
    run = get_backend("onnxruntime").compile(CompileRequest(model, inputs))
    with pytest.raises(MemfitError, match="compile again"):
        run(torch.randn(2, 4, 8, 8))
