"""Prompt embeddings cached by content: a repeated prompt never loads a text encoder, same bits."""

from __future__ import annotations

import numpy as np
import pytest

import memfit
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder

SETTINGS = dict(steps=1, guidance=3.0, seed=5, width=32, height=32, progress=False)


@pytest.fixture
def loads(monkeypatch, tmp_path):
    """Every load_stage call's component names; a private cache directory."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[list[str]] = []
    original = ModelFolder.load_stage

    def spy(self, names, dtype, device, **kwargs):
        calls.append(list(names))
        return original(self, names, dtype, device, **kwargs)

    monkeypatch.setattr(ModelFolder, "load_stage", spy)
    return calls


def _loaded_text_encoder(calls) -> bool:
    return any(name.startswith("text_encoder") for names in calls for name in names)


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_repeated_prompt_skips_text_encoders_and_is_bitwise_same(tiny_models, loads, kind):
    first = memfit.generate("a red house", model=tiny_models(kind), negative_prompt="blurry", **SETTINGS)
    assert _loaded_text_encoder(loads)
    loads.clear()
    second = memfit.generate("a red house", model=tiny_models(kind), negative_prompt="blurry", **SETTINGS)
    assert not _loaded_text_encoder(loads), loads
    assert np.array_equal(np.asarray(first.images[0]), np.asarray(second.images[0]))
    encode = second.report.stages[0]
    assert (encode.stage, encode.components, encode.note, encode.weights_bytes) == ("encode", [], "cache hit", 0)
    assert "cache hit" in second.report.table()


def test_a_different_prompt_or_setting_misses(tiny_models, loads):
    model = tiny_models("sd")
    memfit.generate("a red house", model=model, **SETTINGS)
    for change in ({"prompt": "a blue house"}, {"negative_prompt": "dark"}, {"guidance": 1.0}):
        loads.clear()
        kwargs = {**SETTINGS, "prompt": "a red house", **change}
        memfit.generate(model=model, **kwargs)
        assert _loaded_text_encoder(loads), change


def test_cache_off_and_require(tiny_models, loads, monkeypatch):
    model = tiny_models("sd")
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    for _ in range(2):
        loads.clear()
        memfit.generate("a green tree", model=model, **SETTINGS)
        assert _loaded_text_encoder(loads)
    monkeypatch.setenv("MEMFIT_CACHE", "require")
    with pytest.raises(MemfitError, match="MEMFIT_CACHE=require"):
        memfit.generate("a green tree", model=model, **SETTINGS)
    monkeypatch.setenv("MEMFIT_CACHE", "1")
    memfit.generate("a green tree", model=model, **SETTINGS)
    monkeypatch.setenv("MEMFIT_CACHE", "require")
    loads.clear()
    memfit.generate("a green tree", model=model, **SETTINGS)
    assert not _loaded_text_encoder(loads)


def test_memfit_encode_uses_the_same_cache(tiny_models, loads):
    model = tiny_models("sd")
    embeddings, _ = memfit.encode("a small boat", model=model, negative_prompt="fog")
    loads.clear()
    again, report = memfit.encode("a small boat", model=model, negative_prompt="fog")
    assert not _loaded_text_encoder(loads) and report.stages[0].note == "cache hit"
    assert all((embeddings.tensors[k] == again.tensors[k]).all() for k in embeddings.tensors)
