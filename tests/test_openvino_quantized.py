"""OpenVINO over quantized weights (memfit.compile.backends.openvino_compressed): a component whose linear layers
are stored as int8, Q8_0 or Q4_0 compiles into a model that keeps them compressed (the CPU plugin's
FullyConnected takes int8, int8 and u4 weights) and computes what memfit's eager dequantizing path computes, to
float rounding; other stored formats are still refused before anything loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.compile.backends import CompileRequest, get_backend
from memfit.errors import MemfitError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")
gguf = pytest.importorskip("gguf")

SETTINGS = {"prompt": "a red house near the sea", "steps": 2, "seed": 3, "width": 32, "height": 32}
# The weight input type of the runtime model's FullyConnected layers, by stored format.
COMPRESSED_TYPE = {"int8": "i8", "Q8_0": "i8", "Q4_0": "u4"}


def _quantized_mlp(kind: str, width: int = 128, hidden: int = 256) -> torch.nn.Module:
    """Two linear layers (and a GELU) with their weights stored as ``kind``, as memfit loads them from a file."""
    from memfit.testing.quantized import store_weights

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
    return store_weights(module, kind, ("0", "2")).eval()


def _weight_types(compiled) -> list[str]:
    """The element type of each runtime FullyConnected's weight input (its second)."""
    types = []
    for op in compiled.get_runtime_model().get_ops():
        if op.get_rt_info()["layerType"].astype(str) == "FullyConnected":
            types.append(op.input(1).get_element_type().get_type_name())
    return types


@pytest.mark.parametrize("kind", ["int8", "Q8_0", "Q4_0"])
def test_quantized_layers_compile_to_compressed_weights(kind):
    """The compiled model's layers take their weights compressed (old code: float MatMuls of the dequantized
    bytes), its output is the eager quantized layers' to float rounding (outputs up to 0.6; measured max |difference|
    3e-7 for int8, 1.8e-4 for Q8_0 and 1.6e-4 for Q4_0, whose eager path rounds each d * q to fp16 as diffusers'
    dequantization does; with OpenVINO's default dynamic quantization int8 and Q8_0 were 6e-3 off), and the tensors
    prepared for the export are gone afterwards."""
    from memfit.quant.layers import QuantizedLinear

    module = _quantized_mlp(kind)
    inputs = torch.randn(4, 128)
    with torch.no_grad():
        eager = module(inputs)
    run = get_backend("openvino").compile(CompileRequest(lambda x: module(x), (inputs,), module=module))
    assert _weight_types(run.compiled_model) == [COMPRESSED_TYPE[kind]] * 2
    assert run.compiled_model.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0
    tolerance = 2e-6 if kind == "int8" else 1e-3
    torch.testing.assert_close(run(inputs), eager, atol=tolerance, rtol=0)
    assert all(vars(layer).get("export_weight") is None for layer in module.modules()
               if isinstance(layer, QuantizedLinear))


@pytest.mark.parametrize("kind", ["int8", "Q8_0", "Q4_0"])
def test_bf16_runs_keep_weights_compressed_too(kind):
    """In a bf16 run the pattern is written in bf16, which is what the CPU plugin fuses (in float32 arithmetic it
    decompressed the weights in each call); the output is the eager one to bf16 rounding (measured: 1 bf16 step,
    3.9e-3 at outputs up to 0.6)."""
    import openvino as ov

    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU computes bf16 in float32")
    module = _quantized_mlp(kind)
    for index in (0, 2):
        module[index].bias.data = module[index].bias.data.to(torch.bfloat16)
    inputs = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = module(inputs)
    run = get_backend("openvino").compile(CompileRequest(lambda x: module(x), (inputs,), module=module))
    assert _weight_types(run.compiled_model) == [COMPRESSED_TYPE[kind]] * 2
    torch.testing.assert_close(run(inputs), eager, atol=8e-3, rtol=0)


def test_user_config_keeps_its_dynamic_quantization():
    """memfit turns the CPU plugin's dynamic quantization of activations off for compressed weights, unless asked;
    a module compiled as itself (no ``module`` in the request) is captured compressed too."""
    module = _quantized_mlp("int8")
    inputs = torch.randn(4, 128)
    run = get_backend("openvino").compile(CompileRequest(
        module, (inputs,), options={"config": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}}))
    assert run.compiled_model.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 32
    assert _weight_types(run.compiled_model) == ["i8", "i8"]


@pytest.fixture(scope="module")
def flux(tiny_models):
    return Path(tiny_models("flux"))


@pytest.mark.parametrize("kind", ["int8", "q8_0", "q4_0"])
def test_quantized_transformer_runs_compressed_in_openvino(flux, kind, monkeypatch):
    """--quantize transformer=KIND --backend openvino: refused before; now the run completes with the transformer's
    quantized layers compressed in the compiled model, and draws the eager quantized run's image to a pixel level
    (measured: int8 identical, q8_0 and q4_0 at most 1 of 255 apart); a later run imports the stored model."""
    import memfit.compile.backends.openvino as openvino_backend

    monkeypatch.setenv("MEMFIT_CACHE", "1")  # --quantize keeps its file in the store
    compiled = []
    real_compile = openvino_backend._compile_model
    monkeypatch.setattr(openvino_backend, "_compile_model", lambda *args: compiled.append(real_compile(*args))
                        or compiled[-1])
    quantize = {"transformer": kind}
    eager = memfit.generate(model=flux, quantize=quantize, budget="none", progress=False, **SETTINGS)
    ours = memfit.generate(model=flux, quantize=quantize, budget="none", progress=False,
                           backend={"transformer": "openvino"}, **SETTINGS)
    assert len(compiled) == 1
    assert COMPRESSED_TYPE[kind.upper() if kind != "int8" else kind] in _weight_types(compiled[0])
    difference = np.abs(np.asarray(ours.images[0], dtype=np.int16) - np.asarray(eager.images[0], dtype=np.int16))
    assert difference.max() <= 2
    if kind == "q4_0":  # a later run imports the stored model (u4 weights in the blob): nothing compiles, same image
        again = memfit.generate(model=flux, quantize=quantize, budget="none", progress=False,
                                backend={"transformer": "openvino"}, **SETTINGS)
        assert len(compiled) == 1
        assert np.array_equal(np.asarray(again.images[0]), np.asarray(ours.images[0]))


def test_a_unet_with_quantized_convolutions_runs_in_openvino(tiny_models):
    """--quantize unet=q8_0 quantizes the UNet's convolutions too (QuantizedConv2d): they are captured in the same
    pattern, reshaped to their kernels, and the compiled run draws the eager quantized image to a pixel level."""
    sd = Path(tiny_models("sd"))
    settings = {"prompt": "a red circle", "steps": 2, "width": 32, "height": 32, "seed": 0}
    quantize = {"unet": "q8_0"}
    eager = memfit.generate(model=sd, quantize=quantize, budget="none", progress=False, **settings)
    ours = memfit.generate(model=sd, quantize=quantize, budget="none", progress=False, backend={"unet": "openvino"},
                           **settings)
    assert [c["status"] for s in ours.report.stages for c in s.compiled if c["component"] == "unet"] == ["compiled"]
    difference = np.abs(np.asarray(ours.images[0], dtype=np.int16) - np.asarray(eager.images[0], dtype=np.int16))
    assert difference.max() <= 2


def test_formats_openvino_does_not_keep_are_still_refused(flux):
    """fp8 (OpenVINO expands it to float when it compiles) and the other GGUF types: one sentence, before loading."""
    with pytest.raises(MemfitError, match=r"stored quantized as fp8_e4m3fn in .*, and the openvino backend compiles "
                                          r"a model of its own, which takes quantized weights stored as int8, Q4_0, "
                                          r"Q8_0 only \(--quantize transformer=int8, q4_0, q8_0\)"):
        memfit.generate(model=flux, quantize={"transformer": "fp8"}, budget="none", progress=False,
                        backend={"transformer": "openvino"}, **SETTINGS)


def test_budget_counts_compressed_weights_at_their_stored_size():
    """What a budget counts for a compiled component (compiled_weight_bytes): its stored bytes where OpenVINO keeps
    them compressed, not four bytes a value; ONNX Runtime, which holds floats, still counts floats."""
    from types import SimpleNamespace

    from memfit.compile.entry_points import compiled_weight_bytes

    module = _quantized_mlp("Q4_0")
    pipe = SimpleNamespace(components={"transformer": module})
    stored = sum(layer.weight.numel() for layer in (module[0], module[2]))  # bytes: 18 for each 32 values
    biases = (256 + 128) * 4
    assert compiled_weight_bytes(pipe, ["transformer"], "openvino", torch.float32) == {"transformer": stored + biases}
    if importlib.util.find_spec("onnxruntime") is not None:
        assert compiled_weight_bytes(pipe, ["transformer"], "onnxruntime", torch.float32) == {
            "transformer": stored * 4 + biases}

    # A quantized convolution: OpenVINO folds its pattern into floats when it compiles (its runtime Convolution
    # takes an f32 weight), so its stored bytes count at the held precision, four bytes each here.
    from memfit.quant.formats import StoredTensor, readable_gguf_types
    from memfit.quant.layers import QuantizedConv2d, use_stored_layers

    q8_0 = next(f for f in readable_gguf_types().values() if f.name == "Q8_0")
    convs = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1, bias=False))
    use_stored_layers(convs, {"0.weight": StoredTensor(q8_0, (64, 576))})
    assert isinstance(convs[0], QuantizedConv2d)
    stored = convs[0].weight.numel()  # 34 bytes for each 32 values
    assert compiled_weight_bytes(SimpleNamespace(components={"unet": convs}), ["unet"], "openvino",
                                 torch.float32) == {"unet": stored * 4}
