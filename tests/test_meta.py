"""Meta-device sizing: block partition, dtype arithmetic, tied weights, the real architectures."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from memfit.models.archs import ARCHS, get_arch
from memfit.errors import MemfitError
from memfit.plan.meta import ACTIVATION_FACTORS, ACTIVATION_OFFSETS, activation_estimate, is_model_class, measure_component

TINY_UNET = {
    "block_out_channels": [4, 8],
    "layers_per_block": 1,
    "sample_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32,
    "norm_num_groups": 2,
}
TINY_VAE = {
    "block_out_channels": [4, 8],
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "latent_channels": 4,
    "norm_num_groups": 2,
}
TINY_CLIP = {
    "model_type": "clip_text_model",
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "vocab_size": 1000,
    "max_position_embeddings": 77,
}
TINY_T5 = {"model_type": "t5", "d_model": 32, "d_ff": 37, "d_kv": 8, "num_heads": 4, "num_layers": 2, "vocab_size": 100}


def _real_param_count(library, class_name, config):
    """Independent reference: build the same model for real on the CPU and count (tied once)."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    if library == "diffusers":
        model = getattr(diffusers, class_name).from_config(config)
    else:
        cls = getattr(transformers, class_name)
        model = cls._from_config(cls.config_class.from_dict(config))
    return model, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("library", "class_name", "config"),
    [
        ("diffusers", "UNet2DConditionModel", TINY_UNET),
        ("diffusers", "AutoencoderKL", TINY_VAE),
        ("transformers", "CLIPTextModel", TINY_CLIP),
        ("transformers", "T5EncoderModel", TINY_T5),  # shared embedding tied with encoder.embed_tokens
    ],
)
def test_blocks_partition_every_parameter_exactly_once(library, class_name, config):
    size = measure_component("c", library, class_name, config, "fp32")
    _model, expected = _real_param_count(library, class_name, config)
    assert size.param_count == expected
    assert sum(b.param_count for b in size.blocks) == size.param_count
    assert sum(b.bytes for b in size.blocks) == size.total_bytes
    names = [b.name for b in size.blocks]
    assert len(names) == len(set(names))


def test_unet_blocks_follow_registration_order():
    names = [b.name for b in measure_component("unet", "diffusers", "UNet2DConditionModel", TINY_UNET).blocks]

    def first(prefix):
        return next(i for i, name in enumerate(names) if name == prefix or name.startswith(prefix + "."))

    assert first("down_blocks.0") < first("down_blocks.1") < first("up_blocks.0") < first("up_blocks.1")
    assert names[-1] == "rest"  # conv_in, time embedding, conv_out...: the top-level leaves


def test_large_elements_are_split_further():
    coarse = measure_component("unet", "diffusers", "UNet2DConditionModel", TINY_UNET, max_block_fraction=1.0)
    fine = measure_component("unet", "diffusers", "UNet2DConditionModel", TINY_UNET, max_block_fraction=0.01)
    assert len(fine.blocks) > len(coarse.blocks)
    assert fine.param_count == coarse.param_count
    assert any(b.name.startswith("down_blocks.1.") for b in fine.blocks)
    assert "down_blocks.1" in [b.name for b in coarse.blocks]


def test_bytes_follow_dtype_but_integer_buffers_keep_their_width():
    fp32 = measure_component("te", "transformers", "CLIPTextModel", TINY_CLIP, "fp32")
    bf16 = measure_component("te", "transformers", "CLIPTextModel", TINY_CLIP, "bf16")
    model, params = _real_param_count("transformers", "CLIPTextModel", TINY_CLIP)
    float_elems = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point())
    int_bytes = sum(t.numel() * t.element_size() for t in model.buffers() if not t.is_floating_point())
    assert int_bytes > 0  # position_ids: the case this test is about
    assert fp32.total_bytes == 4 * float_elems + int_bytes
    assert bf16.total_bytes == 2 * float_elems + int_bytes


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc walks deprecated torch objects
def test_results_are_plain_data_and_no_meta_module_survives():
    size = measure_component("vae", "diffusers", "AutoencoderKL", {**TINY_VAE, "latent_channels": 3})

    def leaves(value):
        if dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                yield from leaves(getattr(value, field.name))
        elif isinstance(value, tuple):
            for item in value:
                yield from leaves(item)
        else:
            yield value

    assert all(isinstance(v, (int, str)) for v in leaves(size))
    gc.collect()
    meta_modules = [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.nn.Module) and any(p.is_meta for p in o.parameters(recurse=False))
    ]
    assert meta_modules == []  # a meta template must not outlive sizing


def test_select_keeps_only_the_named_submodules():
    vae = measure_component("vae", "diffusers", "AutoencoderKL", TINY_VAE)
    decoder = vae.select(("decoder",))
    assert decoder.blocks and all(b.name.startswith("decoder.") for b in decoder.blocks)
    assert 0 < decoder.total_bytes < vae.total_bytes
    assert vae.select(None) is vae
    with pytest.raises(MemfitError, match="no blocks under"):
        vae.select(("nonexistent",))


@pytest.mark.parametrize(
    ("library", "class_name", "config", "message"),
    [
        ("diffusers", "NoSuchModel", {}, "NoSuchModel"),
        ("diffusers", "DDIMScheduler", {}, "DDIMScheduler"),  # exists, but is not a model
        ("onnx", "Whatever", {}, "onnx"),
        ("diffusers", "UNet2DConditionModel", {**TINY_UNET, "down_block_types": ["NoSuchBlock2D"]}, "UNet2DConditionModel"),
    ],
)
def test_bad_inputs_raise_memfit_errors_naming_the_culprit(library, class_name, config, message):
    with pytest.raises(MemfitError, match=message):
        measure_component("x", library, class_name, config)


def test_unknown_dtype_lists_valid_ones():
    with pytest.raises(MemfitError, match="fp16"):
        measure_component("unet", "diffusers", "UNet2DConditionModel", TINY_UNET, "int3")


def test_is_model_class():
    assert is_model_class("diffusers", "AutoencoderKL")
    assert not is_model_class("transformers", "CLIPTokenizer")
    # a class of one of diffusers' own pipeline packages is diffusers' code, as from_pretrained resolves it
    assert is_model_class("stable_diffusion", "StableDiffusionSafetyChecker")
    assert is_model_class("ltx2", "LTX2Vocoder")
    assert not is_model_class("my_unet", "MyUNet")  # anything else would be code from the model
    assert not is_model_class("ltx2", "GemmaTokenizer")


# --- the real architectures --------------------------------------------------------------------

REAL_COMPONENTS = [
    pytest.param(arch, spec, id=f"{arch.name}-{spec.name}")
    for arch in ARCHS.values()
    for spec in arch.components
    if spec.expected_params is not None
]


@pytest.mark.parametrize(("arch", "spec"), REAL_COMPONENTS)
def test_meta_param_counts_match_the_published_ones(arch, spec):
    size = measure_component(spec.name, spec.library, spec.class_name, spec.config, "bf16")
    ratio = size.param_count / spec.expected_params
    assert abs(ratio - 1) <= spec.params_tolerance, f"{size.param_count:,} vs {spec.expected_params:,}"


def test_every_stage_uses_known_components_and_the_family_adapter_describes_the_arch():
    from memfit.models.families import ADAPTERS
    from memfit.plan.stages import STAGES, planned_components

    for arch in ARCHS.values():
        adapter = arch.adapter()
        names = {c.name for c in arch.components}
        planned = planned_components(adapter)
        assert all(planned[stage] for stage in STAGES), arch.name
        assert {name for stage in STAGES for name in planned[stage]} <= names
        if arch.class_name in ADAPTERS:  # the same description a model folder of that class gets
            assert type(adapter) is ADAPTERS[arch.class_name]
    assert get_arch("cogview4").adapter().guidance_batch == 1  # CogView4 runs its guidance passes apart
    with pytest.raises(MemfitError, match="sdxl"):
        get_arch("sd3")


# --- activations --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "config"),
    [("unet", TINY_UNET), ("vae_decoder", TINY_VAE), ("transformer", {"hidden_size": 64}), ("text_encoder", TINY_CLIP)],
)
def test_activation_estimate_scales_with_batch_and_dtype(kind, config):
    from memfit.plan.meta import ACTIVATION_OFFSETS

    offset = ACTIVATION_OFFSETS[kind]  # workspace that does not scale
    base = activation_estimate(kind, config, width=512, height=512, batch=1, dtype="fp16") - offset
    assert base > 0
    assert abs(activation_estimate(kind, config, width=512, height=512, batch=2, dtype="fp16") - offset - 2 * base) <= 1
    assert abs(activation_estimate(kind, config, width=512, height=512, batch=1, dtype="fp32") - offset - 2 * base) <= 1


@pytest.mark.parametrize("kind", ["unet", "vae_decoder"])
def test_image_activations_grow_with_pixels(kind):
    config = TINY_UNET if kind == "unet" else TINY_VAE
    from memfit.plan.meta import ACTIVATION_OFFSETS

    small = activation_estimate(kind, config, width=512, height=512) - ACTIVATION_OFFSETS[kind]
    large = activation_estimate(kind, config, width=1024, height=1024) - ACTIVATION_OFFSETS[kind]
    assert 3.5 * small <= large <= 4 * small + 4  # + rounding to whole bytes


def test_flux_tokens_cover_two_by_two_latent_patches():
    flux = get_arch("flux").component("transformer")
    packed = activation_estimate("transformer", flux.config, class_name="FluxTransformer2DModel", text_tokens=0)
    unpacked = activation_estimate("transformer", flux.config, class_name="", text_tokens=0)
    assert unpacked == 4 * packed  # patch_size=1 in the config, yet one token per 2x2 latent pixels


def test_video_vae_decode_counts_the_whole_output_video():
    """Wan's VAE (base_dim 96, 4 video frames per latent frame) returns every frame at once."""
    wan_vae = {"base_dim": 96, "scale_factor_temporal": 4}
    one = activation_estimate("vae_decoder", wan_vae, width=832, height=480, frames=1) - ACTIVATION_OFFSETS["vae_decoder"]
    video = activation_estimate("vae_decoder", wan_vae, width=832, height=480, frames=21)
    longer = activation_estimate("vae_decoder", wan_vae, width=832, height=480, frames=41)
    assert one < video < longer
    per_frame = 3 * 832 * 480 * ACTIVATION_FACTORS["vae_decoder"] * 2  # bf16
    assert longer - video == pytest.approx(20 * 4 * per_frame, rel=0.01)


def test_activation_estimate_rejects_bad_input():
    with pytest.raises(MemfitError, match="unet"):
        activation_estimate("lstm", {})
    with pytest.raises(MemfitError, match="positive"):
        activation_estimate("unet", TINY_UNET, width=0)
