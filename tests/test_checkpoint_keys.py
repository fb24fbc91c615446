"""The checkpoint-key check refuses real faults, not what diffusers and transformers load correctly (issue 17, item 2)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder


def _copy_with(tiny_models, tmp_path, component, change):
    model = tmp_path / "model"
    shutil.copytree(tiny_models("sd"), model)
    path = next((model / component).glob("*.safetensors"))
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return ModelFolder.open(model)


def _load(folder, component):
    return getattr(folder.load_stage([component], torch.float32, torch.device("cpu")), component)


def test_extra_keys_load_with_the_explicit_opt_in(tiny_models, tmp_path, monkeypatch):
    folder = _copy_with(tiny_models, tmp_path, "vae", lambda t: t.__setitem__("extra.weight", torch.zeros(2)))
    with pytest.raises(MemfitError, match="'extra.weight'.*MEMFIT_ALLOW_EXTRA_KEYS=1"):
        _load(folder, "vae")
    monkeypatch.setenv("MEMFIT_ALLOW_EXTRA_KEYS", "1")
    assert isinstance(_load(folder, "vae"), torch.nn.Module)


def test_unsaved_buffers_in_an_older_checkpoint_are_not_unexpected(tiny_models, tmp_path):
    def add_position_ids(tensors):
        key = next(k for k in tensors if k.endswith("embeddings.position_embedding.weight"))
        tensors[key.replace("position_embedding.weight", "position_ids")] = torch.arange(tensors[key].shape[0])[None]

    folder = _copy_with(tiny_models, tmp_path, "text_encoder", add_position_ids)
    assert isinstance(_load(folder, "text_encoder"), torch.nn.Module)


def test_legacy_attention_names_diffusers_converts_are_accepted(tiny_models, tmp_path):
    old_names = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}

    def rename(tensors):
        for key in [k for k in tensors if "mid_block.attentions" in k]:
            for new, old in old_names.items():
                if f".{new}." in key:
                    tensors[key.replace(f".{new}.", f".{old}.")] = tensors.pop(key)

    folder = _copy_with(tiny_models, tmp_path, "vae", rename)
    reference = _load(ModelFolder.open(tiny_models("sd")), "vae")
    loaded = _load(folder, "vae")
    for (name, ours), (_, theirs) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(ours, theirs), name
