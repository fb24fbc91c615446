"""Transformers of Wan, Qwen-Image and SD3 from files of their own, in the keys users' files hold: Wan's original keys
(Comfy's ``wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors``, QuantStack's GGUF), Qwen-Image's diffusers names
(Comfy's ``qwen_image_fp8_e4m3fn.safetensors``, city96's GGUF), SD3's original MMDiT keys (``sd3.5_large.safetensors``,
city96's GGUF), alone or under ComfyUI's ``model.diffusion_model.``.

The files are the tiny pipelines' transformers written that way (memfit.testing.single_file). A safetensors file
draws the folder's own image (or video) bit for bit; a GGUF Q8_0 file draws what diffusers' own GGUF loading of
the same file draws.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import memfit
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, file_places
from memfit.testing import diffusers_output, max_pixel_difference, save_pipeline

WAN = dict(prompt="a red circle drifting right", steps=2, seed=3, width=32, height=32, frames=5)
IMAGE = dict(prompt="a red house near the sea", steps=2, seed=3, width=32, height=32)
SETTINGS = {"wan": WAN, "qwenimage": IMAGE, "sd3": IMAGE}
CLASSES = {"wan": "WanTransformer3DModel", "qwenimage": "QwenImageTransformer2DModel", "sd3": "SD3Transformer2DModel"}
LAYOUTS = {"wan": "Wan", "qwenimage": "diffusers", "sd3": "MMDiT"}


def _frames(result) -> list:
    return list(result.frames) if getattr(result, "frames", None) else list(result.images)


def _transformer_state(folder: Path, kind: str) -> dict[str, torch.Tensor]:
    import diffusers

    from memfit.testing.single_file import sd3_mmdit_state_dict, wan_original_state_dict

    transformer = getattr(diffusers, CLASSES[kind]).from_pretrained(folder / "transformer")
    to_file = {"wan": wan_original_state_dict, "sd3": sd3_mmdit_state_dict}.get(kind, lambda model: model.state_dict())
    return dict(to_file(transformer))


@pytest.mark.parametrize("kind, prefix", [("wan", ""), ("qwenimage", "model.diffusion_model."), ("sd3", "")])
def test_a_transformer_in_its_files_keys_draws_the_folders_image(tiny_models, tmp_path, kind, prefix):
    """--component transformer=FILE.safetensors: Wan's and SD3's original keys are renamed to diffusers' (every weight
    a view of the file but SD3's swapped modulations), Qwen-Image's are diffusers' already; alone or under ComfyUI's
    prefix."""
    folder = Path(tiny_models(kind))
    settings = SETTINGS[kind]
    path = tmp_path / f"{kind}-transformer.safetensors"
    save_file({prefix + key: value.contiguous() for key, value in _transformer_state(folder, kind).items()}, path)
    expected = memfit.generate(model=folder, budget="none", progress=False, **settings)
    ours = memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False, **settings)
    assert max_pixel_difference(_frames(ours), _frames(expected)) == 0
    assert f"transformer from {path} ({LAYOUTS[kind]} layout)" in ours.report.notes[0]
    model = SingleFileModel.with_components(ModelFolder.open(folder), {"transformer": path})
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=["transformer"]).transformer
    places = file_places(transformer)
    swapped = {"norm_out.linear.weight", "norm_out.linear.bias", "transformer_blocks.1.norm1_context.linear.weight",
               "transformer_blocks.1.norm1_context.linear.bias"}
    assert places.materialized == (swapped if kind == "sd3" else set())
    if kind == "sd3":
        assert places.places["transformer_blocks.0.attn.add_k_proj.weight"].key == "joint_blocks.0.context_block.attn.qkv.weight"
    if kind == "wan":
        assert places.places["blocks.0.attn2.to_k.weight"].key == prefix + "blocks.0.cross_attn.k.weight"
        assert places.places["blocks.0.norm2.weight"].key == prefix + "blocks.0.norm3.weight"
    for live, param in transformer.named_parameters():
        if live in places.materialized:
            continue
        assert param.data_ptr() == places.view(live)[2].data_ptr(), live


@pytest.mark.parametrize("kind", ["wan", "qwenimage", "sd3"])
def test_a_gguf_transformer_in_its_files_keys_draws_diffusers_gguf_image(tmp_path, kind):
    """The same keys as a GGUF Q8_0 file (the pipeline at a width whose rows are whole Q8_0 blocks): memfit's image is
    diffusers' from_single_file GGUF loading's of the same file, bit for bit, its linear weights stay stored."""
    import diffusers
    from diffusers import GGUFQuantizationConfig

    from memfit.quant.layers import QuantizedLinear
    from memfit.testing.quantized import save_gguf

    folder = save_pipeline(kind, tmp_path / kind, seed=0, scale=4 if kind == "wan" else 1)
    settings = SETTINGS[kind]
    state = _transformer_state(folder, kind)
    # As city96's converter keeps Wan's modulation tables and SD3's position table (parameters, not weights) in F32.
    path = save_gguf(state, tmp_path / f"{kind}-Q8_0.gguf", "Q8_0", architecture=kind,
                     keep=lambda key: key.endswith("modulation") or key == "pos_embed")
    ours = memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False, **settings)
    transformer = getattr(diffusers, CLASSES[kind]).from_single_file(str(path), config=str(folder), subfolder="transformer", torch_dtype=torch.float32,
                                       quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    theirs = diffusers_output(folder, ours.settings, components={"transformer": transformer})
    assert max_pixel_difference(_frames(ours), theirs) == 0
    unquantized = memfit.generate(model=folder, budget="none", progress=False, **settings)
    assert max_pixel_difference(_frames(ours), _frames(unquantized)) > 0  # the file's weights were used
    model = SingleFileModel.with_components(ModelFolder.open(folder), {"transformer": path})
    loaded = model.load_stage(["transformer"], torch.float32, in_file_dtype=["transformer"]).transformer
    block = loaded.blocks[0].attn1 if kind == "wan" else loaded.transformer_blocks[0].attn
    if kind == "sd3":  # a row slice of the fused qkv, still its stored bytes
        assert file_places(loaded).places["transformer_blocks.0.attn.to_k.weight"].key == "joint_blocks.0.x_block.attn.qkv.weight"
    assert isinstance(block.to_k, QuantizedLinear) and block.to_k.format.name == "Q8_0"


@pytest.mark.parametrize("changes", [dict(qk_norm="rms_norm"), dict(qk_norm="rms_norm", dual_attention_layers=(0,))])
def test_sd35_files_convert_as_diffusers_converts_them(changes):
    """SD3.5 Large's q/k norms and SD3.5 Medium's second attention: memfit's conversion of the MMDiT keys is diffusers'
    converter's, tensor for tensor, and the model's own."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_sd3_transformer_checkpoint_to_diffusers,
    )

    from memfit.models.weight_layouts import MMDIT_SD3
    from memfit.testing.single_file import sd3_mmdit_state_dict

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                  joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
                                  pos_embed_max_size=16, **changes)
    stored = sd3_mmdit_state_dict(model)
    assert "joint_blocks.0.x_block.attn.ln_q.weight" in stored
    assert ("joint_blocks.0.x_block.attn2.qkv.weight" in stored) == ("dual_attention_layers" in changes)
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(dict(stored))
    ours = MMDIT_SD3.convert(dict(stored), dict(model.config), model)
    assert ours.keys() == theirs.keys() == model.state_dict().keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_a_scaled_fp8_wan_transformer_draws_the_upcast_video(tiny_models, tmp_path):
    """Comfy-Org's ``wan2.2_*_fp8_scaled.safetensors``: Wan's keys, each linear weight in fp8 beside a float32
    scale_weight. Held in fp8, it draws the video of the same values upcast when loaded, bit for bit."""
    from safetensors.torch import load_file

    from memfit.quant.layers import QuantizedLinear
    from memfit.testing.quantized import save_fp8

    folder = Path(tiny_models("wan"))
    path = save_fp8(_transformer_state(folder, "wan"), tmp_path / "wan2.2_t2v_fp8_scaled.safetensors", scaled=True)
    stored = load_file(str(path))
    upcast = tmp_path / "wan-upcast.safetensors"
    save_file({key: value.to(torch.float32) * stored.get(key.removesuffix("weight") + "scale_weight", 1.0)
               for key, value in stored.items() if not key.endswith("scale_weight") and key != "scaled_fp8"}, upcast)
    ours = memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False, **WAN)
    expected = memfit.generate(model=folder, components={"transformer": upcast}, budget="none", progress=False, **WAN)
    assert max_pixel_difference(_frames(ours), _frames(expected)) == 0
    model = SingleFileModel.with_components(ModelFolder.open(folder), {"transformer": path})
    to_q = model.load_stage(["transformer"], torch.float32, in_file_dtype=[]).transformer.blocks[0].attn1.to_q
    assert isinstance(to_q, QuantizedLinear) and to_q.format.name == "fp8_e4m3fn" and to_q.stored.scale is not None
