"""The key layouts a model's weights are stored in outside a diffusers folder, and their conversion to diffusers' names.

A Stable Diffusion UNet or VAE is stored in its original (LDM) layout or in diffusers' own (Flux's
VAE, ``ae.safetensors``, is an LDM VAE too); a CLIP text encoder in transformers' layout or, for the
OpenCLIP-trained ones (SD 2's, SDXL's bigG), in OpenCLIP's; a Flux transformer in Black Forest Labs'
original layout (``flux1-dev.safetensors``) or diffusers'; a Wan transformer in Wan's original layout (Comfy's
``wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors``, QuantStack's GGUF files) or diffusers'; a Qwen-Image
transformer in diffusers' names, which its single files keep (Comfy's ``qwen_image_fp8_e4m3fn.safetensors``,
city96's GGUF files); an SD3/SD3.5 transformer in Stability's original MMDiT layout (``sd3.5_large.safetensors``,
city96's GGUF files) or diffusers'; a Chroma transformer in its original keys (Flux's, with the
``distilled_guidance_layer`` approximator) or diffusers'; a Z-Image transformer in its original keys
(``layers.0.attention.qkv.weight``) or diffusers'; a Wan 2.1 or Qwen-Image VAE in Wan's original layout
(ComfyUI's ``wan_2.1_vae.safetensors``, ``qwen_image_vae.safetensors``) or diffusers'; Wan 2.2's 5B VAE in its own
(``wan2.2_vae.safetensors``) or diffusers'; a T5 encoder in transformers' layout (``t5xxl_fp16.safetensors``). A layout
is known by a marker, one tensor name only it has; where that name is found
in a file fixes the prefix the component's tensors share there (``first_stage_model.`` in an
all-in-one checkpoint, nothing in a file of its own), so the same layout reads a component alone
or out of a whole checkpoint.

A converter takes the component's tensors with that prefix removed (views of the file's map), the
component's config and its empty module, and returns them under diffusers' names: diffusers' own
converters where they only rename and take views, or as diffusers does it where it copies.

Text encoders' files (ComfyUI's ``models/text_encoders``): T5 in transformers' or llama.cpp's names; Qwen2.5-VL
(Qwen-Image's) and Qwen3 (Z-Image's, FLUX.2 [klein]'s) in transformers' names, older or newer
(``qwen_2.5_vl_7b.safetensors``: ``model.layers``, ``visual.blocks``; ``qwen_3_4b.safetensors``: Qwen3ForCausalLM's
over a Qwen3Model), or llama.cpp's (their GGUF files), each renamed to the installed transformers' names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from memfit.errors import MemfitError

__all__ = ["AS_SAVED", "BFL_FLUX", "CHROMA", "COMPONENT_LAYOUTS", "LDM_UNET", "LDM_VAE", "LLAMA_CPP_LM",
           "LLAMA_CPP_T5", "MMDIT_SD3", "OPEN_CLIP", "ORIGINAL_WAN", "ORIGINAL_WAN22_VAE", "ORIGINAL_WAN_VAE",
           "ORIGINAL_Z_IMAGE", "QWEN_IMAGE", "SD3_CLIP_L", "TRANSFORMERS_CLIP", "TRANSFORMERS_QWEN3",
           "TRANSFORMERS_QWEN25_VL", "TRANSFORMERS_T5", "Layout", "component_layouts", "find_layouts", "group_counts"]


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


def _convert_sd3_clip_l(tensors: dict, config: dict, module) -> dict:
    """SD3's CLIP-L in transformers' layout. SD3 runs it with a projection that Stability's all-in-one files do not
    hold: the identity, as diffusers' single-file loading and ComfyUI give it, the one tensor materialized. A
    projection the file holds is used as it is."""
    converted = _text_model_names(tensors, module)
    embedding = next((value for key, value in converted.items() if key.endswith("token_embedding.weight")), None)
    if hasattr(module, "text_projection") and "text_projection.weight" not in converted and embedding is not None:
        converted["text_projection.weight"] = torch.eye(embedding.shape[1], dtype=embedding.dtype,
                                                        device=embedding.device)
    return converted


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


# Black Forest Labs' module names -> diffusers' (tensor names end in .weight or .bias; a norm's .scale is
# diffusers' .weight), as diffusers' convert_flux_transformer_checkpoint_to_diffusers renames them.
_FLUX_RENAMES = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder", "img_in": "x_embedder", "final_layer.linear": "proj_out",
}
_FLUX_DOUBLE_RENAMES = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2", "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2", "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
}
_FLUX_SINGLE_RENAMES = {"modulation.lin": "norm.linear", "norm.query_norm": "attn.norm_q",
                        "norm.key_norm": "attn.norm_k", "linear2": "proj_out"}
# A double block's fused projections, split in three equal row ranges.
_FLUX_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_FLUX_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _convert_flux(tensors: dict, config: dict, module) -> dict:
    """Black Forest Labs' layout (``flux1-dev.safetensors``, ComfyUI's ``diffusion_models``) in diffusers' names.

    As diffusers' convert_flux_transformer_checkpoint_to_diffusers, except that the fused projections
    are row slices (views of the file, where diffusers copies them) and a single block's fused q, k, v
    and MLP input is split at the width the file itself has (the fused tensor's column count), where
    diffusers assumes the real model's 3072: a tiny model converts, and a file of another width than
    the config is refused by loading, naming both shapes. The final norm's modulation is stored as
    (shift, scale) and diffusers' as (scale, shift): its weight and bias, concatenated anew, are the
    two tensors materialized. A name this table does not know is kept, so loading names it as extra.
    """
    converted = {}
    for key, value in tensors.items():
        path, _, leaf = key.rpartition(".")
        leaf = "weight" if leaf == "scale" and path.endswith("_norm") else leaf
        block = path.split(".", 2)
        if block[0] in ("double_blocks", "single_blocks") and len(block) == 3:
            kind, index, inner = block
            head = f"transformer_blocks.{index}." if kind == "double_blocks" else f"single_transformer_blocks.{index}."
            if kind == "double_blocks" and inner in _FLUX_FUSED:
                for name, rows in zip(_FLUX_FUSED[inner], value.chunk(3)):
                    converted[f"{head}{name}.{leaf}"] = rows
                continue
            weight = tensors.get(f"{path}.weight")
            if kind == "single_blocks" and inner == "linear1" and weight is not None and weight.ndim == 2 \
                    and value.shape[0] > 3 * weight.shape[1]:
                width = weight.shape[1]
                sizes = (width, width, width, value.shape[0] - 3 * width)
                for name, rows in zip(_FLUX_SINGLE_FUSED, value.split(sizes)):
                    converted[f"{head}{name}.{leaf}"] = rows
                continue
            renames = _FLUX_DOUBLE_RENAMES if kind == "double_blocks" else _FLUX_SINGLE_RENAMES
            converted[f"{head}{renames.get(inner, inner)}.{leaf}"] = value
        elif path == "final_layer.adaLN_modulation.1":
            converted[f"norm_out.linear.{leaf}"] = _swap_halves(value)
        else:
            converted[f"{_FLUX_RENAMES.get(path, path)}.{leaf}"] = value
    return converted


def _convert_chroma(tensors: dict, config: dict, module) -> dict:
    """Chroma's original layout (``chroma-unlocked-v48.safetensors``: Flux's Black Forest Labs keys without the
    per-block modulations, which its ``distilled_guidance_layer`` approximator gives) in diffusers' names, as
    diffusers' convert_chroma_transformer_checkpoint_to_diffusers: the approximator's layers renamed, the rest as
    _convert_flux converts it (fused projections as row slices split at the file's own width, where diffusers
    assumes 3072). Renames and slices only: every tensor stays a view of the file."""
    approximator, rest = {}, {}
    for key, value in tensors.items():
        if not key.startswith("distilled_guidance_layer."):
            rest[key] = value
            continue
        name = key.replace(".in_layer.", ".linear_1.").replace(".out_layer.", ".linear_2.")
        approximator[name.removesuffix(".scale") + ".weight" if ".norms." in name and name.endswith(".scale")
                     else name] = value
    return {**_convert_flux(rest, config, module), **approximator}


def _convert_z_image(tensors: dict, config: dict, module) -> dict:
    """Z-Image's original layout (``z_image_turbo_bf16.safetensors``: ``layers.0.attention.qkv.weight``) in
    diffusers' names, by diffusers' own convert_z_image_transformer_checkpoint_to_diffusers: renames, and the fused
    q, k, v split by torch.chunk (row slices), so every tensor stays a view of the file."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(dict(tensors))


def _convert_wan(tensors: dict, config: dict, module) -> dict:
    """Wan's original layout (``blocks.0.self_attn.q.weight``; Wan 2.1 and 2.2, text, image and 5B models) in
    diffusers' names, by diffusers' own convert_wan_transformer_to_diffusers: renames only, so every tensor stays
    the file's own (a view), and a quantized file's tensors keep their stored bytes."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(tensors))


# Wan's VAE module names -> diffusers' (AutoencoderKLWan's, AutoencoderKLQwenImage's), as diffusers'
# convert_wan_vae_to_diffusers renames them.
_WAN_VAE_RESIDUAL = {"residual.0": "norm1", "residual.2": "conv1", "residual.3": "norm2", "residual.6": "conv2",
                     "shortcut": "conv_shortcut"}
_WAN_VAE_RENAMES = {"conv1": "quant_conv", "conv2": "post_quant_conv", "encoder.conv1": "encoder.conv_in",
                    "decoder.conv1": "decoder.conv_in", "encoder.head.0": "encoder.norm_out",
                    "encoder.head.2": "encoder.conv_out", "decoder.head.0": "decoder.norm_out",
                    "decoder.head.2": "decoder.conv_out"}
_WAN_VAE_BLOCK = re.compile(r"(encoder|decoder)\.(downsamples|upsamples|middle)\.(\d+)\.(.+)")


def _wan_vae_inner(inner: str) -> str:
    """A residual block's inner name (``residual.0.gamma``) as diffusers names it (``norm1.gamma``)."""
    module, _, leaf = inner.rpartition(".")
    return f"{_WAN_VAE_RESIDUAL.get(module, module)}.{leaf}"


def _convert_wan_vae(tensors: dict, config: dict, module) -> dict:
    """Wan 2.1's VAE in its original layout (ComfyUI's ``wan_2.1_vae.safetensors`` and ``qwen_image_vae.safetensors``:
    ``encoder.conv1.weight``, ``decoder.middle.0.residual.0.gamma``) in diffusers' names. As diffusers'
    convert_wan_vae_to_diffusers, which renames only (the RMS norms' gammas are stored in the shape diffusers' norms
    have), so every tensor stays a view of the file; except that the decoder's flat list of blocks is grouped into
    up blocks by the config's num_res_blocks (each up block: num_res_blocks + 1 residual blocks, then its
    upsampler), where diffusers' table assumes the released models' 2. A name this table does not know is kept, so
    loading names it as extra."""
    per_block = config.get("num_res_blocks", 2) + 2
    converted = {}
    for key, value in tensors.items():
        path, _, leaf = key.rpartition(".")
        if path in _WAN_VAE_RENAMES:
            converted[f"{_WAN_VAE_RENAMES[path]}.{leaf}"] = value
            continue
        block = _WAN_VAE_BLOCK.fullmatch(key)
        if block is None:
            converted[key] = value
            continue
        side, kind, index, inner = block.groups()
        index = int(index)
        if kind == "middle":  # residual, attention, residual
            head = f"{side}.mid_block.attentions.0" if index == 1 else f"{side}.mid_block.resnets.{index // 2}"
        elif kind == "downsamples":  # diffusers keeps the encoder's flat list
            head = f"{side}.down_blocks.{index}"
        else:
            up, within = divmod(index, per_block)
            head = f"{side}.up_blocks.{up}." + ("upsamplers.0" if within == per_block - 1 else f"resnets.{within}")
        converted[f"{head}.{_wan_vae_inner(inner)}"] = value
    return converted


# Wan 2.2's VAE (the TI2V-5B's): each encoder level and decoder level is a block of its own, holding its residual
# blocks and then its resampler in one list (``encoder.downsamples.0.downsamples.1.resample.1.weight``).
_WAN22_VAE_BLOCK = re.compile(r"(encoder|decoder)\.(?:down|up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.+)")


def _convert_wan22_vae(tensors: dict, config: dict, module) -> dict:
    """Wan 2.2's VAE in its original layout (the Wan repository's ``Wan2.2_VAE.pth``, ComfyUI's
    ``wan2.2_vae.safetensors``: 48 latent channels, residual levels) in diffusers' names (AutoencoderKLWan with
    is_residual), as diffusers' own conversion script for it renames them (its single-file converter,
    convert_wan_vae_to_diffusers, knows only Wan 2.1's structure): a level's residual blocks are its resnets, the
    entry after them its downsampler or upsampler; the middle, the heads and the quant convolutions as Wan 2.1's.
    Renames only: every tensor stays a view of the file."""
    levels, rest = {}, {}
    for key, value in tensors.items():
        block = _WAN22_VAE_BLOCK.fullmatch(key)
        if block is None:
            rest[key] = value
            continue
        side, level, index, inner = block.groups()
        head = f"{side}.down_blocks.{level}" if side == "encoder" else f"{side}.up_blocks.{level}"
        if inner.split(".")[0] in ("resample", "time_conv"):
            levels[f"{head}.{'downsampler' if side == 'encoder' else 'upsampler'}.{inner}"] = value
        else:
            levels[f"{head}.resnets.{index}.{_wan_vae_inner(inner)}"] = value
    return {**_convert_wan_vae(rest, config, module), **levels}


# Stability's MMDiT module names -> diffusers' (tensor names end in .weight or .bias), as diffusers'
# convert_sd3_transformer_checkpoint_to_diffusers renames them.
_SD3_RENAMES = {"x_embedder.proj": "pos_embed.proj", "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
                "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
                "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
                "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2", "final_layer.linear": "proj_out"}
_SD3_BLOCK_RENAMES = {
    "x_block": {"attn.ln_q": "attn.norm_q", "attn.ln_k": "attn.norm_k", "attn.proj": "attn.to_out.0",
                "attn2.ln_q": "attn2.norm_q", "attn2.ln_k": "attn2.norm_k", "attn2.proj": "attn2.to_out.0",
                "adaLN_modulation.1": "norm1.linear", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2"},
    "context_block": {"attn.ln_q": "attn.norm_added_q", "attn.ln_k": "attn.norm_added_k", "attn.proj": "attn.to_add_out",
                      "adaLN_modulation.1": "norm1_context.linear", "mlp.fc1": "ff_context.net.0.proj",
                      "mlp.fc2": "ff_context.net.2"},
}
# A joint block's fused projections, split in three equal row ranges.
_SD3_FUSED = {("x_block", "attn.qkv"): ("attn.to_q", "attn.to_k", "attn.to_v"),
              ("x_block", "attn2.qkv"): ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
              ("context_block", "attn.qkv"): ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def _swap_halves(value: torch.Tensor) -> torch.Tensor:
    """A modulation stored as (shift, scale), as diffusers' norm takes it: (scale, shift)."""
    shift, scale = value.chunk(2)
    return torch.cat([scale, shift])


def _convert_sd3(tensors: dict, config: dict, module) -> dict:
    """Stability's MMDiT layout (``sd3.5_large.safetensors``, ``joint_blocks.0.x_block.attn.qkv.weight``; SD3 Medium,
    SD3.5 Large with its q/k norms, SD3.5 Medium with its second attention) in diffusers' names.

    As diffusers' convert_sd3_transformer_checkpoint_to_diffusers, except that the fused q, k, v are row slices
    (views of the file, where diffusers copies them). The last block's text side and the final norm store their
    modulation as (shift, scale) and diffusers' as (scale, shift): those, concatenated anew, are the tensors
    materialized. A name this table does not know is kept, so loading names it as extra.
    """
    blocks = [int(key.split(".")[1]) for key in tensors if key.startswith("joint_blocks.")]
    last = max(blocks, default=-1)
    converted = {}
    for key, value in tensors.items():
        if key == "pos_embed":
            converted["pos_embed.pos_embed"] = value
            continue
        path, _, leaf = key.rpartition(".")
        parts = path.split(".", 3)
        if parts[0] == "joint_blocks" and len(parts) == 4:
            _, index, side, inner = parts
            head = f"transformer_blocks.{index}."
            if (side, inner) in _SD3_FUSED:
                for name, rows in zip(_SD3_FUSED[side, inner], value.chunk(3)):
                    converted[f"{head}{name}.{leaf}"] = rows
                continue
            if side == "context_block" and inner == "adaLN_modulation.1" and int(index) == last:
                value = _swap_halves(value)
            converted[f"{head}{_SD3_BLOCK_RENAMES.get(side, {}).get(inner, inner)}.{leaf}"] = value
        elif path == "final_layer.adaLN_modulation.1":
            converted[f"norm_out.linear.{leaf}"] = _swap_halves(value)
        else:
            converted[f"{_SD3_RENAMES.get(path, path)}.{leaf}"] = value
    return converted


def _convert_t5(tensors: dict, config: dict, module) -> dict:
    """transformers' layout (ComfyUI's ``t5xxl_fp16.safetensors``): the names as they are, the token embedding
    once. T5EncoderModel's ``encoder.embed_tokens`` is tied to ``shared``: files hold either name or both, and
    the model is given ``shared`` alone and tied after loading (as from_pretrained ties it), so the weights
    check and the disk tier see one tensor."""
    converted = dict(tensors)
    embedding = converted.pop("encoder.embed_tokens.weight", None)
    if embedding is not None:
        converted.setdefault("shared.weight", embedding)
    return converted


def _convert_llama_cpp_t5(tensors: dict, config: dict, module) -> dict:
    """llama.cpp's names (city96's ``t5-v1_1-xxl-encoder-Q8_0.gguf``, UMT5 GGUF files: ``enc.blk.0.attn_q.weight``)
    in transformers' names, by the gguf package's own map between the two, asked for each tensor the model has;
    the token embedding once, as _convert_t5 gives it."""
    import gguf

    names = gguf.TensorNameMap(gguf.MODEL_ARCH.T5ENCODER, module.config.num_layers)
    live_names = {}
    for live in module.state_dict():
        stored = names.get_name(live, try_suffixes=(".weight", ".bias"))
        if stored is not None and live != "encoder.embed_tokens.weight":
            live_names.setdefault(stored, live)
    return {live_names.get(key, key): value for key, value in tensors.items()}


def _live_name(key: str, live) -> str | None:
    """The name ``live`` (a model's state dict names) gives the file's tensor ``key``: as it is, or with the
    prefixes a causal-LM text encoder's files differ by: transformers' ``model.`` over the bare model (ComfyUI's
    ``qwen_3_4b.safetensors`` is Qwen3ForCausalLM's names, Z-Image's encoder a Qwen3Model), and Qwen2.5-VL's
    older layout (``model.layers``, ``visual.blocks``: ComfyUI's ``qwen_2.5_vl_7b.safetensors``, which
    transformers 5 nests as ``model.language_model`` and ``model.visual``)."""
    bare = key.removeprefix("model.")
    return next((name for name in (key, "model." + key, bare, "model.language_model." + bare) if name in live), None)


class _AbsentVisionTower(torch.nn.Module):
    """Where a Qwen2.5-VL text encoder's vision tower is when its file holds none (llama.cpp's text GGUF keeps it in
    a separate mmproj file, text-only exports leave it out): text-to-image never runs it, so it is not built;
    giving the encoder an image says which file lacked it."""

    def __init__(self, path_hint: str):
        super().__init__()
        self.path_hint = path_hint

    def forward(self, *args, **kwargs):
        raise MemfitError(f"This text encoder was read from a file with no vision tower ({self.path_hint}.* tensors), "
                          "so it encodes text alone; give a file that holds it (ComfyUI's qwen_2.5_vl_7b.safetensors) "
                          "to encode images.")


def _convert_causal_lm(tensors: dict, config: dict, module) -> dict:
    """A transformers text encoder's file (Qwen2.5-VL's, Qwen3's) in the model's own names, by renames alone
    (_live_name). What the file leaves out and the image pipelines never run is made up without a copy: an absent
    LM head (the pipelines read hidden states, never the logits) is the token embedding, as a tied model's is (a
    tied model is tied after loading, as from_pretrained ties it); an absent vision tower is left out of the model
    (_AbsentVisionTower). An LM head the model has no place for (a Qwen3ForCausalLM file for a Qwen3Model) is
    passed over; any other name is kept, so loading names it as extra."""
    live = module.state_dict()
    converted = {}
    for key, value in tensors.items():
        name = _live_name(key, live)
        if name is None and key == "lm_head.weight":
            continue
        converted[name or key] = value
    embedding = next((name for name in ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight",
                                        "embed_tokens.weight") if name in live), None)
    # Qwen2.5-VL's config says it on top, Qwen3's on its one config.
    tied = any(getattr(part, "tie_word_embeddings", False) for part in (module.config, module.config.get_text_config()))
    if "lm_head.weight" in live and "lm_head.weight" not in converted and embedding in converted and not tied:
        converted["lm_head.weight"] = converted[embedding]
    tower = next((path for path in ("model.visual", "visual") if any(name.startswith(path + ".") for name in live)),
                 None)
    if tower is not None and not any(name.startswith(tower + ".") for name in converted):
        parent, _, child = tower.rpartition(".")
        setattr(module.get_submodule(parent), child, _AbsentVisionTower(tower.removeprefix("model.")))
    return converted


def _convert_llama_cpp_causal_lm(tensors: dict, config: dict, module) -> dict:
    """llama.cpp's names (``blk.0.attn_q.weight``, ``token_embd.weight``, ``output_norm.weight``: Qwen2.5-VL's
    and Qwen3's GGUF files) in the model's own names, by the gguf package's map for the model's architecture,
    asked for each tensor the model has under the names transformers' files give it; then as _convert_causal_lm
    (an absent ``output.weight`` is the token embedding, an absent vision tower left out)."""
    import gguf

    architecture = gguf.MODEL_ARCH.QWEN2VL if hasattr(module.config, "vision_config") else gguf.MODEL_ARCH.QWEN3
    names = gguf.TensorNameMap(architecture, module.config.get_text_config().num_hidden_layers)
    stored_names = {}
    for live in module.state_dict():
        for candidate in (live, "model." + live, live.replace("model.language_model.", "model.", 1)):
            stored = names.get_name(candidate, try_suffixes=(".weight", ".bias"))
            if stored is not None:
                stored_names.setdefault(stored, live)
                break
    return _convert_causal_lm({stored_names.get(key, key): value for key, value in tensors.items()}, config, module)


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
SD3_CLIP_L = Layout("transformers", TRANSFORMERS_CLIP.markers, _convert_sd3_clip_l)
OPEN_CLIP = Layout("OpenCLIP", ("positional_embedding",), _convert_open_clip)
BFL_FLUX = Layout("Black Forest Labs", ("double_blocks.0.img_attn.qkv.weight",), _convert_flux)
ORIGINAL_WAN = Layout("Wan", ("blocks.0.self_attn.q.weight",), _convert_wan)
CHROMA = Layout("Chroma", ("distilled_guidance_layer.layers.0.in_layer.weight",), _convert_chroma)
ORIGINAL_Z_IMAGE = Layout("Z-Image", ("layers.0.attention.qkv.weight",), _convert_z_image)
# Wan 2.1's VAE (and Qwen-Image's, the same architecture) in Wan's original names; Wan 2.2's (the 5B's), whose levels
# are blocks of their own.
ORIGINAL_WAN_VAE = Layout("Wan", ("decoder.middle.0.residual.0.gamma",), _convert_wan_vae)
ORIGINAL_WAN22_VAE = Layout("Wan 2.2", ("encoder.downsamples.0.downsamples.0.residual.0.gamma",), _convert_wan22_vae)
MMDIT_SD3 = Layout("MMDiT", ("joint_blocks.0.x_block.attn.qkv.weight",), _convert_sd3)
TRANSFORMERS_T5 = Layout("transformers", ("encoder.block.0.layer.0.SelfAttention.q.weight",), _convert_t5)
LLAMA_CPP_T5 = Layout("llama.cpp", ("enc.blk.0.attn_q.weight",), _convert_llama_cpp_t5)
# Qwen2.5-VL (Qwen-Image's encoder) in transformers' older layout (ComfyUI's qwen_2.5_vl_7b.safetensors) or its
# nested one; Qwen3 (Z-Image's, FLUX.2 [klein]'s) as Qwen3ForCausalLM's (ComfyUI's qwen_3_4b.safetensors) or
# Qwen3Model's names; both as llama.cpp's GGUF files name them.
TRANSFORMERS_QWEN25_VL = Layout("transformers", ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
                                _convert_causal_lm)
TRANSFORMERS_QWEN3 = Layout("transformers", ("model.embed_tokens.weight", "embed_tokens.weight"), _convert_causal_lm)
LLAMA_CPP_LM = Layout("llama.cpp", ("blk.0.attn_q.weight",), _convert_llama_cpp_causal_lm)
# A file memfit wrote (--quantize): the model's own names, whatever its class.
AS_SAVED = Layout("memfit", (), _as_stored)


def _diffusers(marker: str) -> Layout:
    """A component's file in diffusers' own names, known by ``marker``: read as stored."""
    return Layout("diffusers", (marker,), _as_stored)


# Qwen-Image's single files hold diffusers' names (diffusers' own single-file loading renames nothing).
QWEN_IMAGE = _diffusers("transformer_blocks.0.img_mod.1.weight")

# The layouts memfit reads a component's file in, by the component's class.
COMPONENT_LAYOUTS = {
    "UNet2DConditionModel": (LDM_UNET, _diffusers("time_embedding.linear_1.weight")),
    "AutoencoderKL": (LDM_VAE, _diffusers("encoder.conv_norm_out.weight")),
    "CLIPTextModel": (TRANSFORMERS_CLIP, OPEN_CLIP),
    "CLIPTextModelWithProjection": (TRANSFORMERS_CLIP, OPEN_CLIP),
    "FluxTransformer2DModel": (BFL_FLUX, _diffusers("transformer_blocks.0.attn.to_q.weight")),
    "AutoencoderKLWan": (ORIGINAL_WAN22_VAE, ORIGINAL_WAN_VAE, _diffusers("decoder.mid_block.resnets.0.norm1.gamma")),
    "AutoencoderKLQwenImage": (ORIGINAL_WAN_VAE, _diffusers("decoder.mid_block.resnets.0.norm1.gamma")),
    "WanTransformer3DModel": (ORIGINAL_WAN, _diffusers("blocks.0.attn1.to_q.weight")),
    "QwenImageTransformer2DModel": (QWEN_IMAGE,),
    "ChromaTransformer2DModel": (CHROMA, _diffusers("distilled_guidance_layer.layers.0.linear_1.weight")),
    "ZImageTransformer2DModel": (ORIGINAL_Z_IMAGE, _diffusers("layers.0.attention.to_q.weight")),
    "SD3Transformer2DModel": (MMDIT_SD3, _diffusers("transformer_blocks.0.attn.to_q.weight")),
    "T5EncoderModel": (TRANSFORMERS_T5, LLAMA_CPP_T5),
    "UMT5EncoderModel": (TRANSFORMERS_T5, LLAMA_CPP_T5),
    "Qwen2_5_VLForConditionalGeneration": (TRANSFORMERS_QWEN25_VL, LLAMA_CPP_LM),
    "Qwen3Model": (TRANSFORMERS_QWEN3, LLAMA_CPP_LM),
    "Qwen3ForCausalLM": (TRANSFORMERS_QWEN3, LLAMA_CPP_LM),
}


# Where one pipeline's component reads its class's files otherwise: SD3's CLIP-L, which SD3 runs with a projection its
# files (ComfyUI's clip_l.safetensors, Stability's all-in-one files) do not hold, the identity (SD3_CLIP_L). Any other
# CLIP (SD3's CLIP-G, SDXL's bigG) without its projection is still refused as lacking it.
SLOT_LAYOUTS = {("StableDiffusion3Pipeline", "text_encoder"): (SD3_CLIP_L, OPEN_CLIP)}


def component_layouts(pipeline_class: str, name: str, class_name: str) -> tuple[Layout, ...]:
    """The layouts component ``name`` (a ``class_name``) of a ``pipeline_class`` is read from a file in."""
    return SLOT_LAYOUTS.get((pipeline_class, name), COMPONENT_LAYOUTS.get(class_name, ()))


def find_layouts(layouts, keys) -> list[tuple[Layout, str]]:
    """(layout, prefix) for every place in a file (its tensor ``keys``) where a component is stored in one of
    ``layouts`` (component_layouts'), in their order."""
    found = []
    for layout in layouts:
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
