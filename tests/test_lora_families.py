"""LoRAs on the transformer families (Flux, SD3, Qwen-Image, Wan, Chroma and every other family whose
diffusers pipeline has a LoRA loader), through each pipeline's own load_lora_weights, unfused.

Each is held, bitwise at fp32 on CPU, to plain diffusers: from_pretrained, load_lora_weights(file),
set_adapters with the same scale, the same call and seeded generator; with no budget and with a budget
that streams the denoiser's original weights from its files (the LoRA's own tensors stay in memory).
LoRA files in diffusers' (PEFT) format come from the pipeline class's own save_lora_weights; Flux's also
in kohya's format (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``), which diffusers' Flux
loader converts.
"""

import importlib.util

import pytest

import memfit
from conftest import smallest_budget, with_staging_ring
from memfit.models.families import ADAPTERS
from memfit.models.lora import check_loras
from memfit.testing import diffusers_output, generated_output, max_pixel_difference
from memfit.testing.conditioning import save_kohya_flux_lora, save_lora, write_lora

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="LoRAs need peft (pip install memfit[lora])")

BASE = dict(prompt="a red house near the sea", steps=2, seed=5, width=32, height=32)
# kind -> the settings each family runs with (its guidance; Wan's frames)
SETTINGS = {"flux": dict(guidance=3.5), "sd3": dict(guidance=4.5, negative_prompt="blurry"),
            "qwenimage": dict(guidance=1.0), "wan": dict(guidance=1.0, num_frames=5), "chroma": dict(guidance=1.0),
            "sana": dict(guidance=1.0), "aura_flow": dict(guidance=1.0), "lumina2": dict(guidance=1.0),
            "cogview4": dict(guidance=1.0), "hidream": dict(guidance=1.0), "zimage": dict(guidance=0.0),
            "flux_kontext": dict(guidance=3.5), "flux2": dict(guidance=4.0), "flux2_klein": dict(guidance=4.0),
            "ltx": dict(guidance=3.0, negative_prompt="blurry", num_frames=5)}


def _generate(model, loras, kind, **options):
    return memfit.generate(model=model, progress=False, loras=loras, **BASE, **SETTINGS[kind], **options)


def _matches_diffusers(model, loras, kind):
    """memfit.generate with ``loras`` (no budget) equals plain diffusers with them; returns both outputs."""
    ours = _generate(model, loras, kind)
    reference = diffusers_output(model, ours.settings, loras=check_loras(loras))
    assert max_pixel_difference(generated_output(ours), reference) == 0
    return ours, reference


def _streams_and_matches(model, loras, kind, streamed_plans, reference, device=None):
    """The same under the smallest budget, which streams the denoiser's weights from its files (on a GPU from
    disk, the host holding only the staging ring)."""
    budget = smallest_budget(model=model, loras=loras, **BASE, **SETTINGS[kind])
    streamed_plans.clear()
    if device is None:
        ours = _generate(model, loras, kind, budget=budget)
    else:
        ours = with_staging_ring(lambda gpu_budget: _generate(model, loras, kind, budget=gpu_budget, device=device),
                                 budget, model)
    assert max_pixel_difference(generated_output(ours), reference) == 0
    streamed = {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}
    assert streamed["denoise"] > 0, streamed


@pytest.mark.slow  # seven families end to end, twice each
@pytest.mark.parametrize("kind", ["flux", "sd3", "qwenimage", "wan", "chroma", "flux2", "flux2_klein"])
def test_a_peft_lora_equals_diffusers_with_and_without_streaming(tiny_models, tmp_path, streamed_plans, kind):
    model = tiny_models(kind)
    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    ours, reference = _matches_diffusers(model, loras, kind)
    assert "LoRA(s), unfused" in ours.report.stages[1].note
    # The oracle can fail: plain diffusers without the LoRA draws something else.
    assert max_pixel_difference(diffusers_output(model, ours.settings), reference) > 0
    _streams_and_matches(model, loras, kind, streamed_plans, reference)


def test_a_kohya_flux_lora_equals_diffusers_with_and_without_streaming(tiny_models, tmp_path, streamed_plans):
    """A kohya-format Flux LoRA (transformer and CLIP-L layers), converted by diffusers' Flux loader."""
    from safetensors import safe_open

    model = tiny_models("flux")
    file = save_kohya_flux_lora(model, tmp_path / "kohya.safetensors", seed=2)
    with safe_open(file, "pt") as opened:
        assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in opened.keys()
        assert any(key.startswith("lora_te1_") for key in opened.keys())
    loras = [(str(file), 0.8)]
    ours, reference = _matches_diffusers(model, loras, "flux")
    assert [stage.note for stage in ours.report.stages[:2]] == ["1 LoRA(s), unfused"] * 2  # CLIP-L and the transformer
    assert max_pixel_difference(diffusers_output(model, ours.settings), reference) > 0
    _streams_and_matches(model, loras, "flux", streamed_plans, reference)


def test_a_lora_streams_on_a_fake_gpu(tiny_models, tmp_path, streamed_plans):
    """On "cuda" through the lazy fake CUDA runtime (memfit.testing.fake_cuda), the base weights streamed from
    disk and the LoRA's own tensors kept on the host tier: still plain diffusers' image."""
    from memfit.testing.fake_cuda import fake_cuda

    model = tiny_models("flux")
    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    _, reference = _matches_diffusers(model, loras, "flux")
    with fake_cuda(lazy=True) as gpu:
        _streams_and_matches(model, loras, "flux", streamed_plans, reference, device="cuda")
        assert gpu.copies > 0


@pytest.mark.slow  # eight more families end to end
@pytest.mark.parametrize("kind", ["sana", "aura_flow", "lumina2", "cogview4", "hidream", "zimage", "flux_kontext", "ltx"])
def test_a_lora_on_the_other_families_equals_diffusers(tiny_models, tmp_path, kind):
    model = tiny_models(kind)
    _matches_diffusers(model, [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)], kind)


def test_every_family_whose_pipeline_has_a_lora_loader_takes_lora():
    """takes_lora says what memfit runs (each tested above or in test_beyond.py): every family whose diffusers
    pipeline has load_lora_weights, but the SDXL refiner, which runs only after a base model."""
    import diffusers

    has_loader = {name for name in ADAPTERS if hasattr(getattr(diffusers, name, None), "load_lora_weights")}
    takes = {name for name, adapter in ADAPTERS.items() if adapter.takes_lora}
    assert takes == has_loader - {"StableDiffusionXLImg2ImgPipeline"}
    assert "PixArtSigmaPipeline" not in takes


def test_two_loras_and_their_scales(tiny_models, tmp_path):
    """Two LoRAs with their own scales, as --lora A:0.7 --lora B:1.3; another scale draws another image."""
    model = tiny_models("flux")
    pair = [(str(save_lora(model, tmp_path / "a", seed=1)), 0.7),
            (str(save_kohya_flux_lora(model, tmp_path / "b.safetensors", seed=2)), 1.3)]
    _, reference = _matches_diffusers(model, [f"{pair[0][0]}:0.7", pair[1]], "flux")
    assert max_pixel_difference(_generate(model, [pair[0], (pair[1][0], 0.2)], "flux").images, reference) > 0


@pytest.mark.parametrize("modules", [
    {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": (32, 32)},  # an SD LoRA: no Flux component
    {"transformer.blocks.0.attn1.to_q": (32, 32)},  # a Wan LoRA: the Flux transformer has no such module
], ids=["sd-unet", "wan-transformer"])
def test_a_lora_for_another_family_is_one_sentence(tiny_models, tmp_path, modules):
    from memfit.errors import MemfitError

    lora = str(write_lora(tmp_path / "other.safetensors", modules))
    with pytest.raises(MemfitError) as refused:
        _generate(tiny_models("flux"), [lora], "flux")
    assert str(refused.value) == (f"--lora {lora} has no weights for any module of FluxPipeline (transformer, "
                                  "text_encoder): it is a LoRA for another model family; pass a LoRA made for this "
                                  "model's family.")
