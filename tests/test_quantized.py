"""Quantized files as users hold them: a Flux transformer as GGUF (city96's layout: Black Forest Labs' keys, weights
in blocks of Q8_0/Q4_1/...), fp8 safetensors (Comfy's ``*_fp8_e4m3fn``) for the transformer and T5. They stay in
their stored bytes, are planned at that size, stream from their file, and draw diffusers' own image: its GGUF
loading's (from_single_file with GGUFQuantizationConfig) bit for bit, and for fp8 its upcast-on-load image.

The files are the tiny Flux pipeline's, written with the gguf package (memfit.testing.quantized).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from conftest import seeded_image
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, file_places
from memfit.quant.formats import is_stored
from memfit.quant.layers import QuantizedLinear

pytest.importorskip("gguf")

SETTINGS = dict(prompt="a red house near the sea", steps=2, seed=3, width=32, height=32)


@pytest.fixture(scope="module")
def flux(tiny_models, tmp_path_factory):
    """(the tiny Flux folder, a folder for its quantized files, its transformer's state in diffusers' and in Black
    Forest Labs' keys)."""
    from diffusers import FluxTransformer2DModel

    from memfit.testing.single_file import flux_bfl_state_dict

    folder = Path(tiny_models("flux"))
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    return folder, tmp_path_factory.mktemp("quantized"), dict(transformer.state_dict()), flux_bfl_state_dict(transformer)


def _gguf(flux, quant_type: str, layout: str = "bfl") -> Path:
    from memfit.testing.quantized import save_gguf

    _, out, diffusers_state, bfl_state = flux
    path = out / f"flux1-dev-{layout}-{quant_type}.gguf"
    if not path.exists():
        save_gguf(bfl_state if layout == "bfl" else diffusers_state, path, quant_type)
    return path


def _pixels(result):
    return np.asarray(result.images[0], dtype=np.int16)


def _gguf_transformer_draws_diffusers_image(flux, quant_type):
    """memfit's image with the transformer read from a GGUF file in Black Forest Labs' keys is diffusers' GGUF
    loading's of the same weights in its own keys, bit for bit, and not the unquantized image; returns memfit's
    transformer as loaded from the file."""
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    folder = flux[0]
    path = _gguf(flux, quant_type)
    ours = memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False, **SETTINGS)
    transformer = FluxTransformer2DModel.from_single_file(
        str(_gguf(flux, quant_type, "diffusers")), config=str(folder), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
    reference = FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.float32)
    theirs = seeded_image(reference, SETTINGS)
    assert np.array_equal(_pixels(ours), theirs)
    unquantized = _pixels(memfit.generate(model=folder, budget="none", progress=False, **SETTINGS))
    assert not np.array_equal(_pixels(ours), unquantized)  # the quantized weights were used, not the folder's
    model = SingleFileModel.with_components(ModelFolder.open(folder), {"transformer": path})
    return model.load_stage(["transformer"], torch.float32, in_file_dtype=["transformer"]).transformer


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_1", "Q5_0"])
def test_a_gguf_transformer_draws_diffusers_gguf_image(flux, quant_type):
    """--component transformer=FILE.gguf in Black Forest Labs' keys: diffusers' GGUF image, bit for bit; every
    quantized linear weight stays in its stored bytes, a view of the file (the fused projections as row slices)."""
    transformer = _gguf_transformer_draws_diffusers_image(flux, quant_type)
    to_k = transformer.transformer_blocks[0].attn.to_k
    assert isinstance(to_k, QuantizedLinear) and to_k.format.name == quant_type and is_stored(to_k.weight)
    place = file_places(transformer).places["transformer_blocks.0.attn.to_k.weight"]
    assert place.key == "double_blocks.0.img_attn.qkv.weight" and to_k.weight.dtype == torch.int8
    stored = sum(p.numel() * p.element_size() for p in transformer.parameters())
    assert stored < sum(v.numel() * 4 for v in flux[2].values()) / 2


def _transformer_output(transformer) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens, words, width = 16, 8, transformer.config.joint_attention_dim
    inputs = dict(hidden_states=torch.randn(1, tokens, transformer.config.in_channels, generator=generator),
                  encoder_hidden_states=torch.randn(1, words, width, generator=generator),
                  pooled_projections=torch.randn(1, transformer.config.pooled_projection_dim, generator=generator),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(words, 3))
    with torch.no_grad():
        return transformer(**inputs).sample


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_gguf_transformer_streams_from_its_file(flux, prefetch):
    """Every block of a Q4_0 transformer on the disk tier: read from the GGUF file's mapping in its stored bytes
    (never converted), and the output is the resident one's, bit for bit; the planner, given a budget below the
    stored size, streams it from the file too."""
    from memfit.run.offload import HookRegistry

    model = SingleFileModel.with_components(ModelFolder.open(flux[0]), {"transformer": _gguf(flux, "Q4_0")})

    def load():
        return model.load_stage(["transformer"], torch.float32, in_file_dtype=["transformer"])

    expected = _transformer_output(load().transformer)
    pipe = memfit.optimize(load(), force_tiers={"transformer": "disk"}, prefetch=prefetch)
    hooks = [hook for module in pipe.transformer.modules() if (registry := HookRegistry.get(module))
             for hook in registry.hooks.values()]
    assert hooks and all(hook.reads_files for hook in hooks if hasattr(hook, "reads_files"))
    slots = [slot for hook in hooks for slot in getattr(hook, "slots", ())]
    assert any(slot.dtype == torch.int8 and is_stored(slot.tensor) for slot in slots)
    assert torch.equal(_transformer_output(pipe.transformer), expected)

    import re

    with pytest.raises(MemfitError) as refused:  # the one dequantized weight is held beside the activations
        memfit.optimize(load(), budget=1, activation_bytes=0, prefetch=prefetch)
    largest = max(4 * p.numel() for name, p in flux[2].items() if name.endswith(".weight") and p.ndim == 2
                  and p.shape[1] % 32 == 0)
    assert f"activations {largest // 1024}.00 KiB" in str(refused.value)
    smallest = int(re.search(r"smallest budget that works is (\d+) bytes", str(refused.value)).group(1))
    budget = memfit.Budget(device=smallest, host=0, disk=str(model.weights["transformer"].path))
    planned = memfit.optimize(load(), budget=budget, activation_bytes=0, prefetch=prefetch)
    assert planned._memfit_plan.stages[0].streamed_from_disk_bytes > 0
    assert torch.equal(_transformer_output(planned.transformer), expected)


def test_memfit_plan_shows_the_stored_size(flux, capsys):
    """memfit plan --component transformer=FILE.gguf sizes the transformer from the file: its stored bytes, and the
    largest weight dequantized held beside the activations."""
    from memfit.cli.app import main

    folder = flux[0]
    sizes = []
    for extra in ([], ["--component", f"transformer={_gguf(flux, 'Q4_0')}"]):
        assert main(["plan", "--model", str(folder), *extra, "--budget", "1GiB", "--process-memory", "0", "--json"]) == 0
        stages = {stage["name"]: stage for stage in json.loads(capsys.readouterr().out)["plan"]["stages"]}
        sizes.append((sum(p["bytes"] for p in stages["denoise"]["placements"]), stages["denoise"]["activation_bytes"]))
    (folder_bytes, folder_activations), (gguf_bytes, gguf_activations) = sizes
    model = SingleFileModel.with_components(ModelFolder.open(folder), {"transformer": _gguf(flux, "Q4_0")})
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=["transformer"]).transformer
    assert gguf_bytes == sum(p.numel() * p.element_size() for p in transformer.parameters()) < folder_bytes / 4
    largest = max(4 * p.numel() for name, p in flux[2].items() if name.endswith(".weight") and p.ndim == 2
                  and p.shape[1] % 32 == 0)
    assert gguf_activations == folder_activations + largest


def test_a_gguf_transformer_as_the_model_and_in_a_comfyui_folder(flux, tmp_path):
    """--model flux1-dev-Q4_0.gguf --config DIR (ComfyUI's unet/ file): the family from the GGUF header's names and
    shapes; listed and paired in a ComfyUI models folder like a .safetensors transformer."""
    from memfit.models.library import ModelsDir, config_folders

    folder = flux[0]
    path = _gguf(flux, "Q4_0")
    expected = _pixels(memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False,
                                       **SETTINGS))
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0].startswith(f"model: {path.name}, a Flux.1 [dev] single-file checkpoint")
    assert np.array_equal(_pixels(ours), expected)
    models = tmp_path / "models"
    (models / "unet").mkdir(parents=True)
    (models / "unet" / path.name).symlink_to(path)
    configs = tmp_path / "configs"
    shutil.copytree(folder, configs)
    entry = next(e for e in ModelsDir(models, configs=config_folders([configs])).scan().checkpoints)
    assert (entry.name, entry.error, entry.pipeline) == (f"unet/{path.name}", "", "FluxPipeline")


@pytest.mark.parametrize("scaled", [False, True], ids=["fp8", "scaled-fp8"])
def test_fp8_files_draw_the_upcast_image(flux, scaled):
    """A transformer (Black Forest Labs' keys) and a T5 encoder as fp8 e4m3fn safetensors, as Comfy ships them
    (linear weights in fp8, the rest as they were; "scaled": each weight divided by a float32 scale_weight stored
    beside it): held in fp8 and dequantized in each forward, they draw the image of the same values upcast when
    loaded, bit for bit; unscaled, that is diffusers' own image of those weights."""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file, save_file

    from memfit.testing.quantized import save_fp8
    from memfit.testing.single_file import save_flux_files

    folder, out = flux[0], flux[1]
    files = save_flux_files(folder, out / "split")
    name = "scaled" if scaled else "e4m3fn"
    transformer = save_fp8(flux[3], out / f"flux1-dev-fp8-{name}.safetensors", scaled=scaled)
    t5 = save_fp8(load_file(str(files["text_encoder_2"])), out / f"t5xxl_fp8_{name}.safetensors", scaled=scaled)
    components = {"transformer": transformer, "text_encoder_2": t5}
    ours = memfit.generate(model=folder, components=components, budget="none", progress=False, **SETTINGS)

    upcast = {}
    for component, path in components.items():
        stored = load_file(str(path))
        values = {key: value.to(torch.float32) * stored.get(key.removesuffix("weight") + "scale_weight", 1.0)
                  for key, value in stored.items() if not key.endswith("scale_weight") and key != "scaled_fp8"}
        upcast[component] = out / f"{component}-{name}-upcast.safetensors"
        save_file(values, str(upcast[component]))
    expected = memfit.generate(model=folder, components=upcast, budget="none", progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), _pixels(expected))
    if not scaled:  # diffusers' pipeline with the same weights, upcast when loaded
        reference = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float32)
        reference.transformer.load_state_dict({key: value.to(torch.float8_e4m3fn).to(torch.float32)
                                               if value.ndim == 2 and key.endswith(".weight") else value
                                               for key, value in flux[2].items()})
        reference.text_encoder_2.load_state_dict(load_file(str(upcast["text_encoder_2"])), strict=False)
        reference.text_encoder_2.tie_weights()
        assert np.array_equal(_pixels(ours), seeded_image(reference, SETTINGS))

    model = SingleFileModel.with_components(ModelFolder.open(folder), components)
    pipe = model.load_stage(["transformer", "text_encoder_2"], torch.float32, in_file_dtype=[])
    q = pipe.text_encoder_2.encoder.block[0].layer[0].SelfAttention.q
    assert isinstance(q, QuantizedLinear) and q.format.name == "fp8_e4m3fn" and q.weight.dtype == torch.int8
    assert (q.stored.scale is not None) == scaled
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, QuantizedLinear)


def _upcast(path: Path, out: Path) -> Path:
    """The fp8 file ``path``'s values upcast to float32 (times each weight's scale_weight), as a file of its own."""
    from safetensors.torch import load_file, save_file

    stored = load_file(str(path))
    save_file({key: value.to(torch.float32) * stored.get(key.removesuffix("weight") + "scale_weight", 1.0)
               for key, value in stored.items() if not key.endswith("scale_weight") and key != "scaled_fp8"}, str(out))
    return out


@pytest.mark.parametrize("scaled", [False, True], ids=["fp8", "scaled-fp8"])
@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_an_fp8_transformer_as_the_model(flux, tiny_models, tmp_path, kind, scaled):
    """``memfit generate --model flux1-dev-fp8.safetensors --config DIR`` (the transformer alone, fp8 e4m3fn: Comfy's
    plain and "fp8_scaled" files; SD3's in Stability's MMDiT keys likewise): the family from the header, the other
    models from the config folder, the weights held in fp8; the image of the same values upcast, bit for bit."""
    from safetensors.torch import load_file

    from memfit.cli.app import main
    from memfit.testing.quantized import save_fp8
    from memfit.testing.single_file import sd3_mmdit_state_dict

    if kind == "flux":
        folder, state, label = flux[0], flux[3], "Flux.1 [dev]"
    else:
        from diffusers import SD3Transformer2DModel

        folder, label = Path(tiny_models("sd3")), "Stable Diffusion 3"
        state = sd3_mmdit_state_dict(SD3Transformer2DModel.from_pretrained(folder / "transformer"))
    name = "fp8_scaled" if scaled else "fp8_e4m3fn"
    path = save_fp8(state, tmp_path / f"{kind}-{name}.safetensors", scaled=scaled)
    assert any(value.dtype == torch.float8_e4m3fn for value in load_file(str(path)).values())
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0].startswith(f"model: {path.name}, a {label} single-file checkpoint")
    expected = memfit.generate(model=folder, components={"transformer": _upcast(path, tmp_path / "upcast.safetensors")},
                               budget="none", progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), _pixels(expected))
    model = SingleFileModel.open_file(path, config=folder)
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=[]).transformer
    to_q = transformer.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, QuantizedLinear) and to_q.format.name == "fp8_e4m3fn"
    assert (to_q.stored.scale is not None) == scaled
    # The command line: the same image, byte for byte.
    out = tmp_path / "cli.png"
    assert main(["generate", "--model", str(path), "--config", str(folder), "--budget", "none", "--prompt",
                 SETTINGS["prompt"], "--steps", "2", "--seed", "3", "--width", "32", "--height", "32", "--out",
                 str(out)]) == 0
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(out).convert("RGB"), dtype=np.int16), _pixels(ours))


@pytest.mark.parametrize("quant_type", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_read_as_the_gguf_package_reads_them(flux, quant_type):
    """K-quants (flux1-dev-Q4_K_S.gguf holds Q4_K and Q6_K): memfit's values are the gguf package's own reading
    of the same bytes (to fp16's rounding), and a transformer holding them draws diffusers' GGUF image, bit for bit."""
    import gguf

    from memfit.quant.formats import gguf_format
    from memfit.testing.quantized import random_blocks

    kind = gguf.GGMLQuantizationType[quant_type]
    data = random_blocks(quant_type, (8, 512), seed=5)
    theirs = gguf.quants.dequantize(data, kind)
    ours = gguf_format(int(kind), "test").dequantize(torch.from_numpy(data).view(torch.int8), torch.float32)
    assert ours.shape == (8, 512) and np.isfinite(theirs).all()
    # diffusers' arithmetic (which memfit runs, for its images' sake) is fp16 where the gguf package's is fp32:
    # equal to fp16's rounding of the block's terms.
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=2e-3 * np.abs(theirs).max())
    transformer = _gguf_transformer_draws_diffusers_image(flux, quant_type)
    linear = transformer.time_text_embed.timestep_embedder.linear_1  # the tiny model's one row of 256 values
    assert isinstance(linear, QuantizedLinear) and linear.format.name == quant_type


def test_a_lora_over_a_gguf_transformer_is_diffusers(flux, tmp_path, streamed_plans):
    """--lora over a GGUF transformer: applied unfused over the stored weights (as ComfyUI-GGUF applies LoRAs), the
    image is diffusers' of its GGUF model with the same LoRA loaded, bit for bit, and again under the smallest
    budget of the run."""
    pytest.importorskip("peft")
    from conftest import smallest_budget
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    from memfit.testing.conditioning import save_lora

    folder = flux[0]
    loras = [(str(save_lora(str(folder), tmp_path / "lora", seed=1)), 0.7)]
    components = {"transformer": _gguf(flux, "Q8_0")}
    ours = memfit.generate(model=folder, components=components, loras=loras, budget="none", progress=False, **SETTINGS)
    transformer = FluxTransformer2DModel.from_single_file(
        str(_gguf(flux, "Q8_0", "diffusers")), config=str(folder), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
    pipe = FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.float32)
    pipe.load_lora_weights(loras[0][0], adapter_name="style")
    pipe.set_adapters(["style"], [loras[0][1]])
    assert np.array_equal(_pixels(ours), seeded_image(pipe, SETTINGS))
    budget = smallest_budget(model=folder, components=components, loras=loras, **SETTINGS)
    streamed = memfit.generate(model=folder, components=components, loras=loras, budget=budget, progress=False,
                               **SETTINGS)
    assert np.array_equal(_pixels(streamed), _pixels(ours))


def test_a_t5_gguf_in_llama_cpp_names(flux):
    """T5 as city96's t5-v1_1-xxl-encoder-Q8_0.gguf holds it: llama.cpp's names (``enc.blk.0.attn_q.weight``), the
    token embedding once; read through the gguf package's own name map, its image is that of the same values
    dequantized when loaded, bit for bit; a UMT5 encoder (Wan's) reads its names alike."""
    import gguf
    from safetensors.torch import save_file
    from transformers import T5EncoderModel

    from memfit.models.weight_layouts import LLAMA_CPP_T5
    from memfit.quant.formats import gguf_format
    from memfit.testing.quantized import save_gguf

    folder, out = flux[0], flux[1]
    encoder = T5EncoderModel.from_pretrained(folder / "text_encoder_2")
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.T5ENCODER, encoder.config.num_layers)
    state = {names.get_name(key, try_suffixes=(".weight",)): value for key, value in encoder.state_dict().items()
             if key != "encoder.embed_tokens.weight"}
    assert "enc.blk.0.attn_q.weight" in state and "token_embd.weight" in state
    path = save_gguf(state, out / "t5-v1_1-xxl-encoder-Q8_0.gguf", "Q8_0", architecture="t5encoder")
    ours = memfit.generate(model=folder, components={"text_encoder_2": path}, budget="none", progress=False, **SETTINGS)
    assert "text_encoder_2 from " in ours.report.notes[0] and "(llama.cpp layout)" in ours.report.notes[0]

    from memfit.quant.gguf_file import MappedGguf

    mapped = MappedGguf(path)
    assert mapped.formats, "the tiny T5 has rows of whole Q8_0 blocks"
    dequantized = {key: gguf_format(int(gguf.GGMLQuantizationType.Q8_0), key).dequantize(mapped.tensor(key), torch.float32)
                   if key in mapped.formats else mapped.tensor(key).clone() for key in mapped.entries}
    live = LLAMA_CPP_T5.convert(dequantized, {}, encoder)
    save_file(live, str(out / "t5-upcast.safetensors"))
    expected = memfit.generate(model=folder, components={"text_encoder_2": out / "t5-upcast.safetensors"},
                               budget="none", progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), _pixels(expected))

    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        umt5 = UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2))
    stored = {names.get_name(key, try_suffixes=(".weight",)): value for key, value in umt5.state_dict().items()
              if key != "encoder.embed_tokens.weight"}
    assert set(LLAMA_CPP_T5.convert(stored, {}, umt5)) == set(umt5.state_dict()) - {"encoder.embed_tokens.weight"}


def test_quantize_on_the_fly_once(flux, capsys):
    """--quantize transformer=fp8 holds exactly what diffusers' enable_layerwise_casting(storage_dtype=fp8) holds,
    and draws its image bit for bit; q8_0 writes a GGUF file in diffusers' names that diffusers' own GGUF loading
    draws the same image from. Each is quantized once: a second run reads memfit's cache."""
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    from memfit.cache import open_store

    folder = flux[0]
    ours = memfit.generate(model=folder, quantize={"transformer": "fp8"}, budget="none", progress=False, **SETTINGS)
    assert "quantizing transformer to fp8" in capsys.readouterr().err
    assert ours.report.notes[0] == "quantized on the fly (kept in memfit's cache): transformer to fp8"
    reference = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    reference.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert np.array_equal(_pixels(ours), seeded_image(reference, SETTINGS))
    again = memfit.generate(model=folder, quantize={"transformer": "fp8"}, budget="none", progress=False, **SETTINGS)
    assert "quantizing" not in capsys.readouterr().err and np.array_equal(_pixels(again), _pixels(ours))

    ours = memfit.generate(model=folder, quantize={"transformer": "Q8_0"}, budget="none", progress=False, **SETTINGS)
    entries = [entry for entry in open_store().ls("quantized") if entry.meta.get("type") == "q8_0"]
    assert len(entries) == 1
    written = next(entries[0].path.rglob("*.gguf"))
    transformer = FluxTransformer2DModel.from_single_file(
        str(written), config=str(folder), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
    reference = FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.float32)
    theirs = seeded_image(reference, SETTINGS)
    assert np.array_equal(_pixels(ours), theirs)


def test_memfit_plan_sizes_quantize_without_writing(flux, capsys):
    """memfit plan --quantize transformer=q4_0 plans the transformer at the size a run loads it at (the chosen
    weights at 18 bytes a block of 32, the rest at float32), and writes nothing."""
    from memfit.cache import open_store
    from memfit.cli.app import main
    from memfit.models.model_path import open_model_path

    folder = flux[0]
    before = len(open_store().ls("quantized"))
    assert main(["plan", "--model", str(folder), "--quantize", "transformer=q4_0", "--budget", "1GiB",
                 "--process-memory", "0", "--json"]) == 0
    stages = {stage["name"]: stage for stage in json.loads(capsys.readouterr().out)["plan"]["stages"]}
    planned = sum(p["bytes"] for p in stages["denoise"]["placements"])
    assert len(open_store().ls("quantized")) == before
    model = open_model_path(folder, quantize={"transformer": "q4_0"})
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=[]).transformer
    assert planned == sum(p.numel() * p.element_size() for p in transformer.parameters())
    from diffusers import FluxTransformer2DModel

    from memfit.quant.writers import quantized_layers

    unquantized = FluxTransformer2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32)
    saved = sum(layer.weight.numel() for layer in quantized_layers(unquantized, "q4_0").values()) * (4 - 18 / 32)
    assert saved > 0 and planned == sum(v.numel() * 4 for v in flux[2].values()) - saved


def test_resident_quantized_weights_are_kept_dequantized_where_the_budget_has_room(flux):
    """Where the plan leaves room, resident quantized layers keep their weight dequantized (no dequantizing at each
    step; the same values, so the same image); where it has none they stay in their stored bytes; restore drops
    what was kept."""
    from memfit.run.executor import keep_dequantized

    folder = flux[0]
    components = {"transformer": _gguf(flux, "Q8_0")}
    whole = memfit.generate(model=folder, components=components, budget="none", progress=False, **SETTINGS)
    roomy = memfit.generate(model=folder, components=components, budget="4GiB", progress=False, **SETTINGS)
    assert any("of resident quantized weights kept dequantized" in note for note in roomy.report.notes)
    assert np.array_equal(_pixels(roomy), _pixels(whole))

    model = SingleFileModel.with_components(ModelFolder.open(folder), components)
    pipe = memfit.optimize(model.load_stage(["transformer"], torch.float32, in_file_dtype=[]), budget="4GiB",
                           activation_bytes=0)
    layers = [layer for layer in pipe.transformer.modules() if isinstance(layer, QuantizedLinear)]
    one = layers[0].out_features * layers[0].in_features * 4
    assert keep_dequantized(pipe, one, torch.float32) == one and layers[0].dequantized is not None
    assert all(layer.dequantized is None for layer in layers[1:])
    memfit.restore(pipe)
    assert all(layer.dequantized is None for layer in layers)


def _mapped_paths() -> set[str]:
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            paths.add(parts[5].strip())
    return paths


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_a_quantized_component_leaves_the_process_with_its_stage(flux):
    """A GGUF transformer is views of its file's mapping while the denoise stage runs; once the stage is over its
    mapping is closed, so the pages it read do not count in the decode stage's memory (they counted as the process's
    own there: a q8_0 SD 1.5 under 3.5 GiB was refused at the decode stage for its UNet's 2.5 GiB of pages)."""
    path = str(_gguf(flux, "Q8_0"))
    mapped_in: dict[str, bool] = {}

    def on_step(stage, done, total):
        key = stage if done == total == 0 else f"{stage} step"
        mapped_in.setdefault(key, path in _mapped_paths())

    memfit.generate(model=flux[0], components={"transformer": path}, budget="4GiB", progress=False,
                    on_step=on_step, **SETTINGS)
    assert mapped_in["denoise step"], mapped_in
    assert not mapped_in["decode"], mapped_in


def test_a_file_mapping_closes_only_when_no_tensor_shows_it(tmp_path):
    """close_unused_mappings leaves a mapping that a view (a slice of one, too) still shows open, closes it once the
    views are gone, and the file maps again when read."""
    import gc

    from safetensors.torch import save_file

    from memfit.safetensors_header import MappedFile, close_unused_mappings

    save_file({"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}, tmp_path / "w.safetensors")
    mapped = MappedFile(tmp_path / "w.safetensors")
    row = mapped.tensor("w")[3]
    gc.collect()
    close_unused_mappings()
    assert mapped._mapping is not None and str(tmp_path / "w.safetensors") in _mapped_paths()
    assert row[5].item() == 197.0
    del row
    gc.collect()
    close_unused_mappings()
    assert mapped._mapping is None and str(tmp_path / "w.safetensors") not in _mapped_paths()
    assert mapped.tensor("w")[1, 2].item() == 66.0
