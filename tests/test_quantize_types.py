"""--quantize's int8 and K-quants: the quantizers' arithmetic, the layers chosen, the files written, and the images
drawn from them.

int8 (one float32 scale per output row, a safetensors file memfit writes) draws plain diffusers' image with the
dequantized weights loaded, bit for bit; q2_k to q6_k (memfit's own quantizers, llama.cpp's block layouts)
write a GGUF file the gguf package and diffusers' GGUF loading read, and draw the latter's image bit for bit.
Each is quantized once: a second run maps memfit's cache. int8 and the GGUF types quantize the layers downloaded
GGUF files have quantized (AdaLN modulation linears too); fp8 keeps layerwise casting's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from conftest import quantized_file_written, seeded_image

gguf = pytest.importorskip("gguf")

SETTINGS = {"prompt": "a red house near the sea", "steps": 2, "seed": 3, "width": 32, "height": 32}


def _pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def _weights(rows: int, width: int) -> torch.Tensor:
    """Weights as a model's: small values, a row of zeros, a constant row, a row with an outlier."""
    torch.manual_seed(0)
    weights = torch.randn(rows, width) * 0.02
    weights[0] = 0
    weights[1] = 0.5
    weights[2, 7] = 1.0
    return weights


# ---- the quantizers ---------------------------------------------------------------------------------------------


def test_int8_rows_are_symmetric_with_one_scale_each():
    from memfit.quant.formats import INT8_FORMAT, StoredTensor
    from memfit.quant.writers import quantize_int8_rows

    weights = _weights(16, 48)
    values, scale = quantize_int8_rows(weights)
    assert values.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (16,)
    assert scale[0] == 0 and (values[0] == 0).all()
    assert torch.equal(values[1:].abs().amax(dim=1), torch.full((15,), 127, dtype=torch.int8))
    dequantized = StoredTensor(INT8_FORMAT, (16, 48), scale).dequantize(values, torch.float32)
    assert torch.equal(dequantized, values.float() * scale[:, None])
    assert ((dequantized - weights).abs() <= scale[:, None] / 2 + 1e-7).all()
    # bf16: the float32 product rounded once (the same as rounding the float32 weight)
    assert torch.equal(StoredTensor(INT8_FORMAT, (16, 48), scale).dequantize(values, torch.bfloat16),
                       dequantized.to(torch.bfloat16))


MODULATION = ("transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
              "single_transformer_blocks.0.norm.linear")
FIRST_AND_LAST = ("x_embedder", "context_embedder", "time_text_embed.timestep_embedder.linear_1",
                  "time_text_embed.text_embedder.linear_2", "norm_out.linear", "proj_out")


def _tiny_flux():
    """The test pipelines' Flux transformer (32 wide), random weights."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8))


@pytest.mark.parametrize("kind", ["q8_0", "int8"])
def test_weight_only_types_quantize_the_adaln_modulation_linears_and_fp8_does_not(kind):
    """int8 and the GGUF types pick the layers downloaded GGUF files quantize: the AdaLN modulation linears too, not
    the first and last layers nor weights of 1024 values or fewer; fp8 keeps layerwise casting's choice (no norm).
    A model's _keep_in_fp32_modules and _skip_layerwise_casting_patterns (other than "norm") are honoured."""
    from memfit.quant.writers import quantized_layers

    transformer = _tiny_flux()
    chosen = quantized_layers(transformer, kind)
    fp8 = quantized_layers(transformer, "fp8")
    assert set(MODULATION) <= set(chosen) and not set(MODULATION) & set(fp8)
    assert not set(FIRST_AND_LAST) & set(chosen)
    small = "transformer_blocks.0.attn.to_q"  # 32 x 32: 1024 values
    assert small not in chosen and small in fp8
    assert "transformer_blocks.0.ff_context.net.2" in chosen and "single_transformer_blocks.0.proj_mlp" in chosen

    transformer._keep_in_fp32_modules = ["ff_context"]
    transformer._skip_layerwise_casting_patterns = ["pos_embed", "norm", "proj_mlp"]
    honoured = set(quantized_layers(transformer, kind))
    assert set(MODULATION) <= honoured
    assert not any("ff_context" in path or "proj_mlp" in path for path in honoured)


@pytest.mark.parametrize("kind", ["q8_0", "int8"])
def test_a_linear_subclass_stays_in_floats_as_it_loads(kind):
    """A run keeps stored exactly nn.Linear and nn.Conv2d layers (a subclass would be dequantized when loaded and held
    in floats): the writer leaves a subclass alone, so the file, the plan and the run agree on its size."""
    from memfit.quant.writers import quantized_layers

    class Subclass(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(64, 2048), Subclass(2048, 64))
    assert list(quantized_layers(model, kind)) == ["0"]


@pytest.mark.parametrize("kind", ["q8_0", "int8"])
def test_a_written_file_holds_the_chosen_weights_at_the_types_bits(kind, tmp_path):
    """The file's bytes are the chosen weights at the type's bits (Q8_0: 34 bytes a block of 32; int8: a byte a value
    and a float32 scale a row) and every other value at float32, plus a header: smaller than the file the earlier
    choice wrote, which kept the modulation linears at float32."""
    from memfit.quant.writers import quantized_layers, write_quantized

    transformer = _tiny_flux()
    chosen = quantized_layers(transformer, kind)
    path = write_quantized(transformer, kind, tmp_path)
    quantized = sum(layer.weight.numel() for layer in chosen.values())
    rest = sum(value.numel() for value in transformer.state_dict().values()) - quantized
    if kind == "q8_0":
        expected = quantized * 34 // 32 + rest * 4
        types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
        assert all(types[f"{name}.weight"] == "Q8_0" for name in MODULATION)
    else:
        expected = quantized + sum(layer.out_features for layer in chosen.values()) * 4 + rest * 4
        from safetensors import safe_open

        with safe_open(str(path), "pt") as stored:
            assert all(stored.get_slice(f"{name}.weight").get_dtype() == "I8" for name in MODULATION)
    header = 16 * 1024
    size = path.stat().st_size
    assert expected <= size < expected + header
    modulation = sum(transformer.get_submodule(name).weight.numel() for name in MODULATION)
    assert modulation * 2.5 > header  # the earlier file (modulation at float32) fails the bound above


def test_q4_k_blocks_round_trip_through_gguf_and_memfit():
    """memfit's Q4_K bytes dequantize, by the gguf package's own Q4_K dequantizer and by memfit's reader, to the
    weights within 4-bit error: as close as the gguf package's Q4_1 (5 bits a weight) gets, or closer."""
    from memfit.quant.formats import STORAGE_DTYPE, readable_gguf_types
    from memfit.quant.q4_k import quantize_q4_k

    weights = _weights(24, 512)
    blocks = quantize_q4_k(weights)
    assert blocks.dtype == np.uint8 and blocks.shape == (24, 2 * 144)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K))
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    reference = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weights.numpy(), q4_1), q4_1))

    def rmse(values):  # over the random rows
        return (values - weights)[3:].square().mean().sqrt().item()

    assert rmse(theirs) <= rmse(reference) * 1.02 and rmse(theirs) < 0.1 * weights[3:].std().item()
    # Each value within two steps of its sub-block (its range / 15) and the 6-bit rounding of its scale (15 times
    # the super-block's d, its largest step / 63) and minimum (dmin, its largest minimum / 63): a sub-block of
    # small values beside an outlier is coarse, a misplaced byte would be off by its whole range.
    sub = weights.reshape(-1, 8, 32)
    step = (sub.amax(dim=-1) - sub.amin(dim=-1).clamp(max=0)) / 15
    d = step.amax(dim=-1, keepdim=True) / 63
    dmin = (-sub.amin(dim=-1).clamp(max=0)).amax(dim=-1, keepdim=True) / 63
    bound = 2 * step + 15 * d + dmin + 1e-6
    assert ((theirs.reshape(-1, 8, 32) - sub).abs() <= bound[..., None]).all()
    assert torch.equal(theirs[0], torch.zeros(512)) and (theirs[1] - 0.5).abs().max() < 1e-3
    fmt = next(f for f in readable_gguf_types().values() if f.name == "Q4_K")
    ours = fmt.dequantize(torch.from_numpy(blocks).view(STORAGE_DTYPE), torch.float32)
    assert ours.shape == (24, 512) and (ours - theirs).abs().max() <= 2e-3 * weights.abs().max()


@pytest.mark.parametrize("kind, reference_type, ratio", [("q5_k", "Q5_1", 1.02), ("q6_k", "Q5_1", 0.6)])
def test_q5_k_and_q6_k_blocks_round_trip_through_gguf_and_memfit(kind, reference_type, ratio, tmp_path):
    """memfit's Q5_K and Q6_K bytes dequantize, by the gguf package's dequantizers and by memfit's reader, to the
    weights: Q5_K as close as the gguf package's Q5_1 (6 bits a weight), Q6_K well closer; a row of zeros reads
    zeros, a constant row and an outlier read back; write_quantized stores a 256-wide linear layer in the type."""
    from memfit.quant.formats import STORAGE_DTYPE, readable_gguf_types
    from memfit.quant.q5_k import quantize_q5_k
    from memfit.quant.q6_k import quantize_q6_k
    from memfit.quant.writers import GGUF_TYPES, write_quantized

    name = GGUF_TYPES[kind]
    quantize, block_bytes = {"q5_k": (quantize_q5_k, 176), "q6_k": (quantize_q6_k, 210)}[kind]
    weights = _weights(24, 512)
    blocks = quantize(weights)
    assert blocks.dtype == np.uint8 and blocks.shape == (24, 2 * block_bytes)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]))
    reference_kind = gguf.GGMLQuantizationType[reference_type]
    reference = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weights.numpy(), reference_kind),
                                                        reference_kind))

    def rmse(values):  # over the random rows
        return (values - weights)[3:].square().mean().sqrt().item()

    assert rmse(theirs) <= rmse(reference) * ratio
    assert torch.equal(theirs[0], torch.zeros(512)) and (theirs[1] - 0.5).abs().max() < 1e-3
    assert abs(theirs[2, 7].item() - 1.0) < 5e-3
    fmt = next(f for f in readable_gguf_types().values() if f.name == name)
    ours = fmt.dequantize(torch.from_numpy(blocks).view(STORAGE_DTYPE), torch.float32)
    assert ours.shape == (24, 512) and (ours - theirs).abs().max() <= 2e-3 * weights.abs().max()

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 8))
    path = write_quantized(layer, kind, tmp_path)
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert types == {"0.weight": name, "0.bias": "F32"}


def _plain_grid_error(weights: torch.Tensor, kind: str) -> float:
    """The rms error of ``kind``'s grid on sub-blocks of 16 with exact float scales and no fitting: Q3_K's -4..3 with
    the largest magnitude at -4, Q2_K's 0..3 spanning the minimum (never above 0) to the maximum."""
    sub = weights.reshape(-1, 16)
    if kind == "q3_k":
        scale = sub.gather(-1, sub.abs().argmax(dim=-1, keepdim=True)) / -4
        read = torch.round(sub / scale).clamp(-4, 3) * scale
    else:
        low = sub.amin(dim=-1, keepdim=True).clamp(max=0)
        step = (sub.amax(dim=-1, keepdim=True) - low) / 3
        read = torch.round((sub - low) / step).clamp(0, 3) * step + low
    return (read - sub).square().mean().sqrt().item()


@pytest.mark.parametrize("kind, block_bytes", [("q3_k", 110), ("q2_k", 84)])
def test_q3_k_and_q2_k_blocks_round_trip_through_diffusers(kind, block_bytes, tmp_path):
    """memfit's Q3_K and Q2_K bytes dequantize, by diffusers' own dequantizers (the reference), the gguf package's and
    memfit's reader alike, to the weights within their bits' error: no more than the plain grid with exact float
    scales gives, nor much less (the fitted scales, quantized to 6 and 4 bits, gain a little); between Q4_K's error
    and the next type down's. A row of zeros reads zeros, a constant row and an outlier read back; write_quantized
    stores a 256-wide linear layer in the type."""
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, dequantize_functions

    from memfit.quant.formats import STORAGE_DTYPE, readable_gguf_types
    from memfit.quant.q2_k import quantize_q2_k
    from memfit.quant.q3_k import quantize_q3_k
    from memfit.quant.q4_k import quantize_q4_k
    from memfit.quant.writers import GGUF_TYPES, write_quantized

    name = GGUF_TYPES[kind]
    quantize = {"q3_k": quantize_q3_k, "q2_k": quantize_q2_k}[kind]
    kind_type = gguf.GGMLQuantizationType[name]
    weights = _weights(24, 512)
    blocks = quantize(weights)
    assert blocks.dtype == np.uint8 and blocks.shape == (24, 2 * block_bytes)
    assert GGML_QUANT_SIZES[kind_type] == (256, block_bytes)
    theirs = dequantize_functions[kind_type](torch.from_numpy(blocks).reshape(-1, block_bytes), 256, block_bytes,
                                             torch.float32).reshape(24, 512)
    assert torch.equal(theirs, torch.from_numpy(gguf.quants.dequantize(blocks, kind_type)))
    fmt = next(f for f in readable_gguf_types().values() if f.name == name)
    ours = fmt.dequantize(torch.from_numpy(blocks).view(STORAGE_DTYPE), torch.float32)
    assert ours.shape == (24, 512) and (ours - theirs).abs().max() <= 2e-3 * weights.abs().max()

    def rmse(values):  # over the random rows
        return (values - weights)[3:].square().mean().sqrt().item()

    plain = _plain_grid_error(weights[3:], kind)
    assert 0.75 * plain <= rmse(theirs) <= plain
    q4_k = torch.from_numpy(gguf.quants.dequantize(quantize_q4_k(weights), gguf.GGMLQuantizationType.Q4_K))
    lower = quantize_q2_k(weights) if kind == "q3_k" else None
    assert rmse(q4_k) < rmse(theirs)
    if lower is not None:
        assert rmse(theirs) < rmse(torch.from_numpy(gguf.quants.dequantize(lower, gguf.GGMLQuantizationType.Q2_K)))
    assert torch.equal(theirs[0], torch.zeros(512)) and (theirs[1] - 0.5).abs().max() < 1e-3
    assert abs(theirs[2, 7].item() - 1.0) < 5e-3

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 8))
    path = write_quantized(layer, kind, tmp_path)
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert types == {"0.weight": name, "0.bias": "F32"}


# ---- on the fly ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux(tiny_models):
    return Path(tiny_models("flux"))


@pytest.fixture(scope="module")
def wide_flux(tmp_path_factory):
    """A tiny Flux 256 wide: its attention projections are whole Q4_K super-blocks."""
    from memfit.testing import save_pipeline

    return save_pipeline("flux", tmp_path_factory.mktemp("wide-flux") / "flux", seed=0, scale=8)


def test_int8_on_the_fly_is_diffusers_with_the_dequantized_weights(flux, capsys, streamed_plans, monkeypatch):
    """--quantize transformer=int8: every linear layer of the transformer outside the skipped ones stays int8 in
    memory; the image is plain diffusers' with the file's weights dequantized (int8 * scale) and loaded, bit for
    bit, close to the unquantized one; a second run maps the cached file; a streaming budget draws the same."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import load_file

    from memfit.models.model_path import open_model_path
    from memfit.quant.formats import INT8_FORMAT, is_stored
    from memfit.quant.layers import QuantizedLinear
    from memfit.quant.writers import quantized_layers

    monkeypatch.setenv("MEMFIT_CACHE", "1")  # the quantized file is kept; streamed_plans turns the cache off
    quantize = {"transformer": "int8"}
    ours = memfit.generate(model=flux, quantize=quantize, budget="none", progress=False, **SETTINGS)
    assert "quantizing transformer to int8" in capsys.readouterr().err
    unquantized = _pixels(memfit.generate(model=flux, budget="none", progress=False, **SETTINGS))
    assert not np.array_equal(_pixels(ours), unquantized) and _psnr(_pixels(ours), unquantized) > 40

    written = load_file(str(quantized_file_written("int8")))
    transformer = FluxTransformer2DModel.from_pretrained(flux / "transformer", torch_dtype=torch.float32)
    chosen = quantized_layers(transformer, "int8")
    assert chosen and all(isinstance(layer, torch.nn.Linear) for layer in chosen.values())
    for path, layer in chosen.items():
        assert written[f"{path}.weight"].dtype == torch.int8
        assert written[f"{path}.weight_scale"].shape == (layer.out_features,)
    state = {key: value for key, value in written.items() if not key.endswith(".weight_scale")}
    for key, value in state.items():
        if value.dtype == torch.int8:
            state[key] = value.float() * written[key + "_scale"][:, None]
    transformer.load_state_dict(state)
    reference = FluxPipeline.from_pretrained(flux, transformer=transformer, torch_dtype=torch.float32)
    theirs = seeded_image(reference, SETTINGS)
    assert np.array_equal(_pixels(ours), theirs)

    again = memfit.generate(model=flux, quantize=quantize, budget="none", progress=False, **SETTINGS)
    assert "quantizing" not in capsys.readouterr().err and np.array_equal(_pixels(again), _pixels(ours))

    loaded = open_model_path(flux, quantize=quantize).load_stage(["transformer"], torch.float32, in_file_dtype=[])
    layers = [layer for layer in loaded.transformer.modules() if isinstance(layer, QuantizedLinear)]
    assert len(layers) == len(chosen) and all(layer.format is INT8_FORMAT and is_stored(layer.weight)
                                                for layer in layers)

    from conftest import smallest_budget

    budget = smallest_budget(model=flux, quantize=quantize, **SETTINGS)
    streamed_plans.clear()
    streamed = memfit.generate(model=flux, quantize=quantize, budget=budget, progress=False, **SETTINGS)
    assert np.array_equal(_pixels(streamed), _pixels(ours))
    denoise = next(plan for plan in streamed_plans if plan.stages[0].name == "denoise")
    assert denoise.stages[0].streamed_from_disk_bytes > 0


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q3_k", "q2_k"])
def test_k_quants_on_the_fly_are_diffusers_gguf_loading(wide_flux, capsys, kind):
    """--quantize transformer=q4_k (q5_k, q6_k) writes a GGUF file of K-quant blocks (the 256-wide layers) that
    diffusers' GGUF loading draws memfit's image from, bit for bit; close to the unquantized image; a second run
    maps it."""
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    from memfit.quant.writers import GGUF_TYPES

    quantize = {"transformer": kind}
    ours = memfit.generate(model=wide_flux, quantize=quantize, budget="none", progress=False, **SETTINGS)
    assert f"quantizing transformer to {kind}" in capsys.readouterr().err
    unquantized = _pixels(memfit.generate(model=wide_flux, budget="none", progress=False, **SETTINGS))
    assert not np.array_equal(_pixels(ours), unquantized) and _psnr(_pixels(ours), unquantized) > 35

    path = quantized_file_written(kind)
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert types["transformer_blocks.0.attn.to_q.weight"] == GGUF_TYPES[kind]
    assert types["transformer_blocks.0.norm1.linear.weight"] == GGUF_TYPES[kind]
    assert set(types.values()) <= {GGUF_TYPES[kind], "F32"}
    transformer = FluxTransformer2DModel.from_single_file(
        str(path), config=str(wide_flux), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
    reference = FluxPipeline.from_pretrained(wide_flux, transformer=transformer, torch_dtype=torch.float32)
    theirs = seeded_image(reference, SETTINGS)
    assert np.array_equal(_pixels(ours), theirs)

    again = memfit.generate(model=wide_flux, quantize=quantize, budget="none", progress=False, **SETTINGS)
    assert "quantizing" not in capsys.readouterr().err and np.array_equal(_pixels(again), _pixels(ours))


@pytest.mark.parametrize("kind", ["int8", "q4_k", "q2_k"])
def test_memfit_plan_sizes_the_new_types_without_writing(wide_flux, capsys, kind):
    """memfit plan --quantize transformer=KIND plans the transformer at the bytes a run loads, writing nothing."""
    from memfit.cache import open_store
    from memfit.cli.app import main
    from memfit.models.model_path import open_model_path

    assert main(["plan", "--model", str(wide_flux), "--quantize", f"transformer={kind}", "--budget", "1GiB",
                 "--process-memory", "0", "--json"]) == 0
    stages = {stage["name"]: stage for stage in json.loads(capsys.readouterr().out)["plan"]["stages"]}
    planned = sum(p["bytes"] for p in stages["denoise"]["placements"])
    assert open_store().ls("quantized") == []
    model = open_model_path(wide_flux, quantize={"transformer": kind})
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=[]).transformer
    assert planned == sum(p.numel() * p.element_size() for p in transformer.parameters())
    from diffusers import FluxTransformer2DModel

    unquantized = FluxTransformer2DModel.from_pretrained(wide_flux / "transformer", torch_dtype=torch.float32)
    assert planned < sum(p.numel() * p.element_size() for p in unquantized.parameters()) / 2


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="this torch has no int8 matmul")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_matmul_when_turned_on_is_the_dequantized_layer_up_to_rounding(monkeypatch, dtype):
    """memfit.quant.layers.INT8_MATMUL (off: docs/int8_matmul.md) multiplies the stored int8 weight directly; its
    output is the dequantizing layer's within the compute dtype's rounding, bias and leading dimensions kept."""
    from memfit.quant import layers as linear
    from memfit.quant.formats import INT8_FORMAT, StoredTensor
    from memfit.quant.writers import quantize_int8_rows

    values, scale = quantize_int8_rows(_weights(48, 64))
    layer = linear.QuantizedLinear(64, 48, StoredTensor(INT8_FORMAT, (48, 64), scale), bias=True, device="cpu")
    layer.weight.data = values
    layer.bias.data = torch.randn(48)
    inputs = torch.randn(2, 5, 64).to(dtype)
    dequantized = layer(inputs)
    monkeypatch.setattr(linear, "INT8_MATMUL", True)
    taken = []
    runs = linear._int8_matmul_runs
    monkeypatch.setattr(linear, "_int8_matmul_runs", lambda *args: taken.append(runs(*args)) or taken[-1])
    direct = layer(inputs)
    assert taken == [True]
    assert direct.shape == (2, 5, 48) and direct.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (direct.float() - dequantized.float()).abs().max() <= tolerance * dequantized.float().abs().max()
    assert not torch.equal(direct, torch.zeros_like(direct))


def test_a_layouts_row_conversion_carries_each_rows_int8_scale():
    """A conversion that splits a fused int8 weight by rows, or joins two, takes each row's scale with it: the
    converted tensors dequantize to the converted dequantized weights."""
    from memfit.quant.formats import INT8_FORMAT, StoredTensor
    from memfit.quant.rows import convert_stored
    from memfit.quant.writers import quantize_int8_rows

    fused, other = _weights(12, 8), _weights(4, 8) * 3
    tensors, stored = {}, {}
    for name, weight in (("qkv.weight", fused), ("extra.weight", other)):
        tensors[name], scale = quantize_int8_rows(weight)
        stored[name] = StoredTensor(INT8_FORMAT, tuple(weight.shape), scale)

    def convert(state):
        q, k, v = state["qkv.weight"].chunk(3)
        return {"q.weight": q, "k.weight": k, "joined.weight": torch.cat([v, state["extra.weight"]])}

    values = {name: stored[name].dequantize(tensor, torch.float32) for name, tensor in tensors.items()}
    expected = convert(values)
    converted, formats = convert_stored(convert, tensors, stored, "test")
    assert set(formats) == set(expected)
    for name, weight in expected.items():
        assert formats[name].scale.shape == (weight.shape[0],)
        assert torch.equal(formats[name].dequantize(converted[name], torch.float32), weight)
