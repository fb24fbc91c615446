"""The key each live weight of a component has in the component's own safetensors files.

transformers loads some checkpoints under other names than the files hold (transformers 5 moves
Qwen2.5-VL's language model under ``model.language_model``), and its ``save_pretrained`` reverts
those renamings when it writes. Reading a weight straight from the file (the disk tier) needs the
same reverse, taken from transformers itself so it stays right for every model it knows.
"""

from __future__ import annotations

import re

import torch

__all__ = ["saved_keys"]


def saved_keys(module: torch.nn.Module) -> dict[str, str]:
    """Live parameter name -> the key save_pretrained writes it under, where the two differ.

    Names that save_pretrained keeps, and weights it does not save one-to-one (a converter that
    merges or splits tensors), are absent: such a weight has no single key in the file.
    """
    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: a regex table on the class
        return _reverted_by_table(names, getattr(module, "_checkpoint_conversion_mapping", None) or {})
    # Placeholders stand for the tensors: a renaming passes each through unchanged, so identity
    # pairs a live name with its saved key without touching a weight.
    placeholders = {name: torch.empty(0, device="meta") for name in names}
    by_identity = {id(tensor): name for name, tensor in placeholders.items()}
    try:
        saved = revert_weight_conversion(module, placeholders)
    except Exception:  # a converter that cannot run on placeholders: no key is known for it
        return {}
    keys = {}
    for key, tensor in saved.items():
        name = by_identity.get(id(tensor))
        if name is not None and name != key:
            keys[name] = key
    return keys


def _reverted_by_table(names: list[str], table: dict[str, str]) -> dict[str, str]:
    """transformers 4's save_pretrained: the first reversed pattern that matches renames the key."""
    keys = {}
    for name in names:
        for live, file_pattern in ((v, k) for k, v in table.items()):
            renamed, count = re.subn(live, re.sub(r"\(.*\)", "", file_pattern.lstrip("^")), name)
            if count:
                keys[name] = renamed
                break
    return keys
