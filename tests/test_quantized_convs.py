"""--quantize on a UNet with an 8-bit type: its 2-D convolutions are quantized too and stay in their stored bytes
(QuantizedConv2d, dequantized one layer at a time), as its linear layers do; fewer bits leave them in floats. The
tiny SD pipeline's UNet quantized to q8_0 and int8 holds less than with its convolutions in floats and draws plain diffusers' image with the file's weights
dequantized (independently: the gguf package's, int8 * scale) and loaded, bit for bit; fp8 still holds what
diffusers' layerwise casting holds, its convolutions now fp8 in memory too; a streaming budget, ``memfit plan``
and a LoRA over a quantized convolution agree with the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from conftest import quantized_file_written, seeded_image
from memfit.quant.formats import is_stored
from memfit.quant.layers import QuantizedConv2d, StoredWeightLayer

gguf = pytest.importorskip("gguf")

SETTINGS = {"prompt": "a red house near the sea", "steps": 2, "seed": 3, "width": 32, "height": 32}
#: Stored bytes per value: int8 one (its scale per row beside it), q8_0 34 per 32.
BYTES_PER_VALUE = {"int8": 1.0, "q8_0": 34 / 32}


@pytest.fixture(scope="module")
def sd(tiny_models):
    return Path(tiny_models("sd"))


def _pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


def _dequantized_file(path: Path, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every tensor of a file memfit wrote, read and dequantized without memfit (the gguf package's reader and
    diffusers' GGUF dequantizers; int8 times its row's scale) and shaped as the model's ``shapes``."""
    if path.suffix == ".gguf":
        from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, dequantize_functions

        state = {}
        for tensor in gguf.GGUFReader(path).tensors:
            data = torch.from_numpy(np.array(tensor.data))
            if tensor.tensor_type in dequantize_functions:
                block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
                data = dequantize_functions[tensor.tensor_type](data.view(torch.uint8).reshape(-1, type_size),
                                                                block_size, type_size)
            state[tensor.name] = data
    else:
        from safetensors.torch import load_file

        written = load_file(str(path))
        state = {key: value.float() * written[key + "_scale"][:, None] if value.dtype == torch.int8 else value
                 for key, value in written.items() if not key.endswith("_scale")}
    return {key: value.reshape(shapes[key]) for key, value in state.items()}


def _unet_bytes(model, quantize) -> tuple[torch.nn.Module, int]:
    from memfit.models.model_path import open_model_path

    unet = open_model_path(model, quantize=quantize).load_stage(["unet"], torch.float32, in_file_dtype=[]).unet
    return unet, sum(p.numel() * p.element_size() for p in unet.parameters())


@pytest.mark.parametrize("kind", ["q8_0", "int8"])
def test_a_quantized_unet_keeps_its_convolutions_stored_and_draws_diffusers_image(sd, kind, monkeypatch):
    """--quantize unet=KIND: every convolution the type chooses is a QuantizedConv2d in its stored bytes, so the
    UNet holds its chosen weights, convolutions included, at the type's size; the image is plain diffusers'
    with the file's weights dequantized and loaded, bit for bit."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from memfit.quant.writers import quantized_layers

    monkeypatch.setenv("MEMFIT_CACHE", "1")
    quantize = {"unet": kind}
    ours = memfit.generate(model=sd, quantize=quantize, budget="none", progress=False, **SETTINGS)

    plain = UNet2DConditionModel.from_pretrained(sd / "unet", torch_dtype=torch.float32)
    chosen = quantized_layers(plain, kind)
    convs = {path for path, layer in chosen.items() if type(layer) is torch.nn.Conv2d}
    assert convs and not any(path.startswith(("conv_in", "conv_out")) for path in convs)
    unet, stored = _unet_bytes(sd, quantize)
    for path in convs:
        layer = unet.get_submodule(path)
        assert isinstance(layer, QuantizedConv2d) and isinstance(layer, torch.nn.Conv2d) and is_stored(layer.weight)
        assert layer.logical_shape == tuple(plain.get_submodule(path).weight.shape)
    floats = sum(p.numel() * 4 for p in plain.parameters())
    saved = sum(layer.weight.numel() for layer in chosen.values()) * (4 - BYTES_PER_VALUE[kind])
    assert stored == floats - saved

    shapes = {key: value.shape for key, value in plain.state_dict().items()}
    plain.load_state_dict(_dequantized_file(quantized_file_written(kind), shapes))
    reference = StableDiffusionPipeline.from_pretrained(sd, unet=plain, torch_dtype=torch.float32)
    theirs = seeded_image(reference, SETTINGS)
    assert np.array_equal(_pixels(ours), theirs)
    unquantized = _pixels(memfit.generate(model=sd, budget="none", progress=False, **SETTINGS))
    assert not np.array_equal(_pixels(ours), unquantized)


@pytest.mark.parametrize("kind", ["q4_0", "q5_0"])
def test_fewer_bits_leave_the_convolutions_in_floats(sd, kind):
    """A 4- or 5-bit type quantizes the linear layers only: at those bits the convolutions lose too much."""
    from diffusers import UNet2DConditionModel

    from memfit.quant.writers import quantized_layers

    plain = UNet2DConditionModel.from_pretrained(sd / "unet", torch_dtype=torch.float32)
    chosen = quantized_layers(plain, kind)
    assert chosen and all(isinstance(layer, torch.nn.Linear) for layer in chosen.values())
    assert {path for path, layer in quantized_layers(plain, "q8_0").items() if isinstance(layer, torch.nn.Conv2d)}


def test_fp8_keeps_layerwise_castings_image_with_its_convolutions_fp8_in_memory(sd):
    """--quantize unet=fp8: diffusers' enable_layerwise_casting(storage_dtype=fp8) image, bit for bit; its
    convolutions' weights stay fp8 in memory (QuantizedConv2d in their 4-D shape), not dequantized when loaded."""
    from diffusers import StableDiffusionPipeline

    ours = memfit.generate(model=sd, quantize={"unet": "fp8"}, budget="none", progress=False, **SETTINGS)
    reference = StableDiffusionPipeline.from_pretrained(sd, torch_dtype=torch.float32)
    reference.unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert np.array_equal(_pixels(ours), seeded_image(reference, SETTINGS))
    unet, _ = _unet_bytes(sd, {"unet": "fp8"})
    conv = unet.down_blocks[0].resnets[0].conv1
    assert isinstance(conv, QuantizedConv2d) and conv.format.name == "fp8_e4m3fn"
    assert conv.weight.shape == conv.logical_shape and conv.weight.dtype == torch.int8


def test_a_streaming_budget_draws_the_unbudgeted_image(sd, streamed_plans):
    """The smallest budget of a q8_0 UNet streams it from its file, convolutions in their stored bytes: the image
    is the unbudgeted one, bit for bit."""
    from conftest import smallest_budget

    quantize = {"unet": "q8_0"}
    whole = memfit.generate(model=sd, quantize=quantize, budget="none", progress=False, **SETTINGS)
    budget = smallest_budget(model=sd, quantize=quantize, **SETTINGS)
    streamed_plans.clear()
    streamed = memfit.generate(model=sd, quantize=quantize, budget=budget, progress=False, **SETTINGS)
    assert np.array_equal(_pixels(streamed), _pixels(whole))
    denoise = next(plan for plan in streamed_plans if plan.stages[0].name == "denoise")
    assert denoise.stages[0].streamed_from_disk_bytes > 0


def test_kept_dequantized_convolutions_draw_the_same_image(sd):
    """Where the budget has room, resident quantized convolutions keep their weight dequantized in its 4-D shape;
    the image is the one dequantized at each step."""
    from memfit.models.model_path import open_model_path
    from memfit.run.executor import keep_dequantized

    quantize = {"unet": "q8_0"}
    whole = memfit.generate(model=sd, quantize=quantize, budget="none", progress=False, **SETTINGS)
    roomy = memfit.generate(model=sd, quantize=quantize, budget="4GiB", progress=False, **SETTINGS)
    assert any("of resident quantized weights kept dequantized" in note for note in roomy.report.notes)
    assert np.array_equal(_pixels(roomy), _pixels(whole))

    model = open_model_path(sd, quantize=quantize)
    pipe = memfit.optimize(model.load_stage(["unet"], torch.float32, in_file_dtype=[]), budget="4GiB",
                           activation_bytes=0)
    layers = [layer for layer in pipe.unet.modules() if isinstance(layer, StoredWeightLayer)]
    assert keep_dequantized(pipe, None, torch.float32) == sum(layer.dequantized_bytes(torch.float32)
                                                                for layer in layers)
    conv = next(layer for layer in layers if isinstance(layer, QuantizedConv2d))
    assert conv.dequantized.shape == conv.logical_shape
    memfit.restore(pipe)
    assert all(layer.dequantized is None for layer in layers)


def test_memfit_plan_sizes_the_quantized_convolutions(sd, capsys):
    """memfit plan --quantize unet=q8_0 plans the UNet at the size a run loads it at, convolutions quantized, and
    writes nothing."""
    from memfit.cache import open_store
    from memfit.cli.app import main

    assert main(["plan", "--model", str(sd), "--quantize", "unet=q8_0", "--budget", "1GiB", "--process-memory", "0",
                 "--json"]) == 0
    stages = {stage["name"]: stage for stage in json.loads(capsys.readouterr().out)["plan"]["stages"]}
    planned = sum(p["bytes"] for p in stages["denoise"]["placements"])
    assert not open_store().ls("quantized")
    _, loaded = _unet_bytes(sd, {"unet": "q8_0"})
    assert planned == loaded
    # A built-in architecture has no weights to quantize: refused, not planned unquantized.
    assert main(["plan", "--arch", "sd15", "--quantize", "unet=q4_0"]) != 0
    assert "--quantize are for a model given as --model" in capsys.readouterr().err


def test_a_lora_over_quantized_convolutions_is_diffusers(sd, tmp_path):
    """A LoRA on a UNet's convolutions and attention, over a q8_0 UNet: applied unfused over the stored weights, the
    image is diffusers' with the dequantized weights and the same LoRA loaded, bit for bit."""
    pytest.importorskip("peft")
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(1)
    unet = UNet2DConditionModel.from_pretrained(sd / "unet", torch_dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["conv1", "conv2", "to_q"])
    unet.add_adapter(config)
    lora = tmp_path / "lora"
    StableDiffusionPipeline.save_lora_weights(lora, unet_lora_layers=get_peft_model_state_dict(unet),
                                              weight_name="lora.safetensors", safe_serialization=True)
    loras = [(str(lora / "lora.safetensors"), 0.7)]
    quantize = {"unet": "q8_0"}
    ours = memfit.generate(model=sd, quantize=quantize, loras=loras, budget="none", progress=False, **SETTINGS)

    plain = UNet2DConditionModel.from_pretrained(sd / "unet", torch_dtype=torch.float32)
    loaded, _ = _unet_bytes(sd, quantize)
    assert any(isinstance(layer, QuantizedConv2d) for layer in loaded.modules())
    plain.load_state_dict({name: layer.dequantize_weight(torch.float32)
                           for path, layer in loaded.named_modules() if isinstance(layer, StoredWeightLayer)
                           for name in [f"{path}.weight"]} | {
        key: value for key, value in loaded.state_dict(keep_vars=True).items() if not is_stored(value)}, strict=True)
    pipe = StableDiffusionPipeline.from_pretrained(sd, unet=plain, torch_dtype=torch.float32)
    pipe.load_lora_weights(loras[0][0], adapter_name="style")
    pipe.set_adapters(["style"], [loras[0][1]])
    assert np.array_equal(_pixels(ours), seeded_image(pipe, SETTINGS))
    without = memfit.generate(model=sd, quantize=quantize, budget="none", progress=False, **SETTINGS)
    assert not np.array_equal(_pixels(ours), _pixels(without))


def test_a_banded_decode_runs_a_quantized_vaes_convolutions():
    """A VAE whose convolutions are int8 QuantizedConv2d decodes as the same VAE with those weights dequantized and
    loaded, bit for bit, and in bands (memfit.run.banded_decode calls F.conv2d with each layer's weight, which
    for a quantized one is its dequantized weight) within the banded decode's own tolerance."""
    from diffusers import AutoencoderKL

    from memfit.quant.formats import INT8_FORMAT, StoredTensor
    from memfit.quant.layers import use_stored_layers
    from memfit.quant.writers import quantize_int8_rows, quantized_layers
    from memfit.run.banded_decode import enable_banded_decode

    def vae():
        torch.manual_seed(0)
        return AutoencoderKL(block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D"] * 2,
                             up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=8).eval()

    quantized, plain = vae(), vae()
    state, stored = plain.state_dict(), {}
    convs = {path: layer for path, layer in quantized_layers(quantized, "int8").items()
             if type(layer) is torch.nn.Conv2d and path.startswith("decoder.")}
    assert convs and "decoder.conv_in" not in convs and "decoder.conv_out" not in convs  # its first and last
    for path, layer in convs.items():
        values, scale = quantize_int8_rows(layer.weight.detach().flatten(1))
        stored[f"{path}.weight"] = StoredTensor(INT8_FORMAT, tuple(values.shape), scale)
        state[f"{path}.weight"] = values
    use_stored_layers(quantized, stored)
    quantized.load_state_dict(state)
    plain.load_state_dict({name: quantized.get_submodule(name.removesuffix(".weight")).dequantize_weight(torch.float32)
                           if name in stored else value for name, value in state.items()})
    z = torch.randn(1, 4, 12, 10, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, whole = plain.decode(z).sample, quantized.decode(z).sample
        enable_banded_decode(quantized, band_bytes=64 * 1024)
        banded = quantized.decode(z).sample
    assert torch.equal(whole, expected)
    assert (banded - expected).abs().max().item() <= 1e-5


def test_a_file_of_an_older_writer_is_not_reused(sd, capsys, monkeypatch):
    """The cache key names the writer's version: a file written before convolutions were quantized (another
    version) is quantized anew, not read back with its convolutions in floats."""
    import memfit.models.quantize as quantize_module

    monkeypatch.setenv("MEMFIT_CACHE", "1")
    current = quantize_module.WRITER_VERSION
    for version, quantizes in [("older", True), (current, True), (current, False)]:
        monkeypatch.setattr(quantize_module, "WRITER_VERSION", version)
        memfit.generate(model=sd, quantize={"unet": "q8_0"}, budget="none", progress=False, **SETTINGS)
        assert ("quantizing unet to q8_0" in capsys.readouterr().err) == quantizes


def test_a_scaled_fp8_unet_file_keeps_its_convolutions_fp8(sd, tmp_path):
    """A UNet file as Comfy's scaled fp8 files hold one (each linear and convolution weight in fp8 beside a float32
    scale_weight): its convolutions are QuantizedConv2d in their 4-D shape, no longer dequantized when loaded, and
    the image is that of the same values upcast when loaded, bit for bit."""
    from safetensors.torch import load_file, save_file

    plain = load_file(str(sd / "unet" / "diffusion_pytorch_model.safetensors"))
    stored, upcast = {}, {}
    for key, value in plain.items():
        if key.endswith(".weight") and value.ndim in (2, 4):
            scale = value.abs().max() / torch.finfo(torch.float8_e4m3fn).max
            stored[key], stored[key.removesuffix("weight") + "scale_weight"] = (value / scale).to(torch.float8_e4m3fn), scale
            upcast[key] = stored[key].to(torch.float32) * scale
        else:
            stored[key] = upcast[key] = value
    stored["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(stored, str(tmp_path / "unet-fp8-scaled.safetensors"))
    save_file(upcast, str(tmp_path / "unet-upcast.safetensors"))

    ours = memfit.generate(model=sd, components={"unet": tmp_path / "unet-fp8-scaled.safetensors"}, budget="none",
                           progress=False, **SETTINGS)
    expected = memfit.generate(model=sd, components={"unet": tmp_path / "unet-upcast.safetensors"}, budget="none",
                               progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), _pixels(expected))

    from memfit.models.folder import ModelFolder
    from memfit.models.single_file import SingleFileModel

    model = SingleFileModel.with_components(ModelFolder.open(sd), {"unet": tmp_path / "unet-fp8-scaled.safetensors"})
    unet = model.load_stage(["unet"], torch.float32, in_file_dtype=[]).unet
    conv = unet.down_blocks[0].resnets[0].conv1
    assert isinstance(conv, QuantizedConv2d) and conv.weight.shape == conv.logical_shape
    assert conv.stored.scale is not None and conv.stored.scale.ndim == 0
