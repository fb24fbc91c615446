"""PipelineAdapter.denoise is a template method: every family runs the base's, with the runner's
arguments (split, inputs), and changes only its hooks (denoise_call, after_loop, fit_lengths, ...)."""

import inspect

import pytest

from memfit.errors import MemfitError
from memfit.models.families import ADAPTERS, PipelineAdapter, Settings

SETTINGS = Settings(prompt="a red house", negative_prompt="blurry", steps=2, guidance=5.0, seed=7, width=32, height=32,
                    true_cfg_scale=4.0)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_denoise_is_the_base_template_with_its_signature(name):
    adapter = ADAPTERS[name]
    assert inspect.signature(adapter.denoise) == inspect.signature(PipelineAdapter.denoise)
    overriding = [cls.__name__ for cls in adapter.__mro__ if cls is not PipelineAdapter and "denoise" in vars(cls)]
    assert not overriding, f"{overriding} override denoise; override its hooks (denoise_call, after_loop) instead"


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_split_is_refused_once_where_there_is_no_batch_to_split(name):
    adapter = ADAPTERS[name]
    assert not (adapter.splits_guidance and adapter.separate_guidance_passes), name
    if adapter.splits_guidance:
        return
    expected = "already runs its guidance passes separately" if adapter.separate_guidance_passes else \
        "cannot split its guidance passes"
    with pytest.raises(MemfitError, match=expected):  # refused before the pipeline is touched
        adapter({}, {}).denoise(None, {}, SETTINGS, None, split=True)


@pytest.mark.parametrize("name", sorted(name for name, adapter in ADAPTERS.items() if adapter.needs_image))
def test_a_family_that_needs_an_image_plans_its_task_and_refuses_a_run_without_it(name):
    """needs_image is all such a family sets: the base plans the image task's denoise components (with the VAE
    that encodes the image) and refuses a request without the image, saying which flags it needs."""
    from memfit.models.families import Conditioning

    adapter = ADAPTERS[name]({}, {})
    assert adapter.image_task in adapter.tasks
    assert adapter.stage_components("denoise") == adapter.task_denoise_components(adapter.image_task)
    assert "vae" in adapter.stage_components("denoise") and "vae" not in adapter.denoise_components
    with pytest.raises(MemfitError, match=f"{adapter.class_name} .*: pass --image IMG"):
        adapter.refuse_missing_image(Conditioning())
    overriding = [cls.__name__ for cls in type(adapter).__mro__ if cls is not PipelineAdapter and "stage_components" in vars(cls)]
    assert not overriding, f"{overriding} override stage_components; set needs_image instead"


def test_families_that_take_an_image_optionally_plan_text_to_image():
    from memfit.models.families import Conditioning

    flux_kontext = ADAPTERS["FluxKontextPipeline"]({}, {})
    assert not flux_kontext.needs_image and "vae" not in flux_kontext.stage_components("denoise")
    flux_kontext.refuse_missing_image(Conditioning())  # draws from the prompt alone
