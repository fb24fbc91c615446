"""The key layouts a model's weights are stored in outside a diffusers folder, and their conversion to diffusers' names.

A Stable Diffusion UNet or VAE is stored in its original (LDM) layout or in diffusers' own; a CLIP
text encoder in transformers' layout or, for the OpenCLIP-trained ones (SD 2's, SDXL's bigG), in
OpenCLIP's. A layout is known by a marker, one tensor name only it has; where that name is found
in a file fixes the prefix the component's tensors share there (``first_stage_model.`` in an
all-in-one checkpoint, nothing in a file of its own), so the same layout reads a component alone
or out of a whole checkpoint.

A converter takes the component's tensors with that prefix removed (views of the file's map), the
component's config and its empty module, and returns them under diffusers' names: diffusers' own
converters where they only rename and take views, or as diffusers does it where it copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["COMPONENT_LAYOUTS", "LDM_UNET", "LDM_VAE", "Layout", "OPEN_CLIP", "TRANSFORMERS_CLIP", "find_layouts",
           "group_counts"]


def _convert_unet(tensors: dict, config: dict, module) -> dict:
    from diffusers.loaders.single_file_utils import LDM_UNET_KEY, convert_ldm_unet_checkpoint

    # diffusers' converter reads the UNet under the prefix it has in an all-in-one checkpoint.
    return convert_ldm_unet_checkpoint({LDM_UNET_KEY + key: value for key, value in tensors.items()}, config)


def _convert_vae(tensors: dict, config: dict, module) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return convert_ldm_vae_checkpoint(tensors, config)


def _as_stored(tensors: dict, config: dict, module) -> dict:
    return dict(tensors)


def _text_model_names(tensors: dict, module) -> dict:
    """CLIP names with the ``text_model.`` level the class has: transformers 5.6 flattened CLIPTextModel (its
    names no longer start with text_model.), CLIPTextModelWithProjection still wraps it; files hold either."""
    inner = dict(module.text_model.named_children()) if hasattr(module, "text_model") else {}
    converted = {}
    for key, value in tensors.items():
        name = key.removeprefix("text_model.")
        converted["text_model." + name if name.split(".")[0] in inner else name] = value
    return converted


def _convert_clip(tensors: dict, config: dict, module) -> dict:
    """transformers' layout (an LDM checkpoint's CLIP-L, ComfyUI's clip_l): the names as they are."""
    return _text_model_names(tensors, module)


def _convert_open_clip(tensors: dict, config: dict, module) -> dict:
    """OpenCLIP's layout (SD 2's encoder, SDXL's bigG) in diffusers' names, by diffusers' own rename tables.

    As diffusers' convert_open_clip_checkpoint, except that q, k and v are row slices of the fused
    in_proj (views of the file, where diffusers copies them); the projection is stored transposed and
    so is the one tensor materialized. What the model does not have is left out as diffusers leaves
    it: SD 2 uses the penultimate layer, so its config has one layer fewer than the file, and no
    projection.
    """
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    tables = DIFFUSERS_TO_LDM_MAPPING["openclip"]
    has_projection = hasattr(module, "text_projection")
    converted = {}
    for new, old in tables["layers"].items():
        if old in tensors and (old != "text_projection" or has_projection):
            value = tensors[old]
            converted[new] = value.T.contiguous() if old == "text_projection" else value
    hidden = module.config.hidden_size
    layers = module.config.num_hidden_layers
    for key, value in tensors.items():
        if not key.startswith("transformer.") or int(key.split(".")[2]) >= layers:
            continue
        name = key.removeprefix("transformer.")
        for new, old in tables["transformer"].items():
            name = name.replace(old, new)
        base, fused, kind = name.rpartition(".in_proj_")
        if not fused:
            converted[name] = value
            continue
        for index, projection in enumerate(("q_proj", "k_proj", "v_proj")):
            converted[f"{base}.{projection}.{kind}"] = value[index * hidden:(index + 1) * hidden]
    return _text_model_names(converted, module)


@dataclass(frozen=True)
class Layout:
    """A way a component's weights are stored: ``name`` for messages; ``markers``, tensor names only this layout
    has (the first found fixes the component's prefix in a file); ``convert(tensors, config, empty module)``
    to diffusers' names."""

    name: str
    markers: tuple[str, ...]
    convert: Callable[[dict, dict, torch.nn.Module], dict]

    def describe(self) -> str:
        return f"{self.name} ({self.markers[0]!r})"


LDM_UNET = Layout("LDM", ("time_embed.0.weight",), _convert_unet)
LDM_VAE = Layout("LDM", ("encoder.norm_out.weight",), _convert_vae)
TRANSFORMERS_CLIP = Layout("transformers", ("text_model.embeddings.token_embedding.weight",
                                            "embeddings.token_embedding.weight"), _convert_clip)
OPEN_CLIP = Layout("OpenCLIP", ("positional_embedding",), _convert_open_clip)

# The layouts memfit reads a component's file in, by the component's class.
COMPONENT_LAYOUTS = {
    "UNet2DConditionModel": (LDM_UNET, Layout("diffusers", ("time_embedding.linear_1.weight",), _as_stored)),
    "AutoencoderKL": (LDM_VAE, Layout("diffusers", ("encoder.conv_norm_out.weight",), _as_stored)),
    "CLIPTextModel": (TRANSFORMERS_CLIP, OPEN_CLIP),
    "CLIPTextModelWithProjection": (TRANSFORMERS_CLIP, OPEN_CLIP),
}


def find_layouts(class_name: str, keys) -> list[tuple[Layout, str]]:
    """(layout, prefix) for every place in a file (its tensor ``keys``) where a component of ``class_name`` is
    stored in a layout memfit reads, in COMPONENT_LAYOUTS' order."""
    found = []
    for layout in COMPONENT_LAYOUTS.get(class_name, ()):
        for marker in layout.markers:
            prefixes = [key[:-len(marker)] for key in keys
                        if key == marker or key.endswith("." + marker)]
            if prefixes:
                found += [(layout, prefix) for prefix in sorted(prefixes)]
                break
    return found


def group_counts(keys, limit: int = 6) -> str:
    """The largest groups of tensor names by their first word, e.g. "model.* (686), first_stage_model.* (248)"."""
    counts: dict[str, int] = {}
    for key in keys:
        top = key.split(".")[0] + "."
        counts[top] = counts.get(top, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])[:limit]
    return ", ".join(f"{top}* ({count})" for top, count in ranked) or "none"
