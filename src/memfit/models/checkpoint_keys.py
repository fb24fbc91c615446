"""The names a component's checkpoint keys take once loaded: what loading renames, and back.

diffusers renames pre-2023 attention keys (query, key, value, proj_attn) while loading, and
transformers renames some checkpoints' keys (transformers 5 moves Qwen2.5-VL's language model under
``model.language_model``). Checking a loaded model against its files, and reading a live weight
straight from its file (the disk tier), need the same renaming, taken from the libraries
themselves so it stays right for every model they know.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["loaded_names"]


def loaded_names(module: torch.nn.Module, keys: Iterable[str]) -> dict[str, str] | None:
    """Checkpoint key -> the name ``module`` gives that tensor once loaded.

    None when loading also merges or splits tensors (a transformers converter), so keys and live
    names do not pair one to one.
    """
    keys = list(keys)
    fix_keys = getattr(module, "_fix_state_dict_keys_on_load", None)
    if callable(fix_keys):  # diffusers renames the dict in place; each value here is its original key
        renamed = {key: key for key in keys}
        try:
            returned = fix_keys(renamed)
        except Exception:  # noqa: BLE001 - a diffusers internal changed; diffusers itself checked the load
            return None
        return {key: name for name, key in (returned if isinstance(returned, dict) else renamed).items()}
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {key: key for key in keys}
    if not isinstance(module, PreTrainedModel):
        return {key: key for key in keys}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: names are the checkpoint's
        return {key: key for key in keys}
    try:
        transforms = get_model_conversion_mapping(module)
        if any(not isinstance(t, WeightRenaming) for t in transforms):
            return None
        if not transforms and not getattr(module, "base_model_prefix", None):
            return {key: key for key in keys}
        state = module.state_dict()
        return {key: rename_source_key(key, transforms, [], module.base_model_prefix, state)[0] for key in keys}
    except Exception:  # noqa: BLE001 - a transformers internal changed; transformers itself checked the load
        return None
