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
