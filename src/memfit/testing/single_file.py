"""All-in-one single-file checkpoints made from the tiny pipelines: diffusers' conversion run backwards.

A1111, Forge and ComfyUI keep a Stable Diffusion model as one ``.safetensors`` file in the original
(LDM) key layout: the UNet under ``model.diffusion_model.``, the VAE under ``first_stage_model.``,
the CLIP text encoder under ``cond_stage_model.transformer.`` (SDXL: its two text encoders under
``conditioner.embedders.0.transformer.`` and, in OpenCLIP's layout, ``conditioner.embedders.1.model.``;
build the tiny SDXL as kind "sdxl_single_file" for diffusers to read it back). ``save_single_file`` writes a tiny
pipeline's weights that way, by the inverse of diffusers' own converters
(diffusers.loaders.single_file_utils), and checks the round trip: diffusers' converters turn the
file back into exactly the folder's tensors.

ComfyUI keeps Flux as split files: the transformer alone in Black Forest Labs' original keys
(``flux1-dev.safetensors``), the VAE in LDM keys with no prefix (``ae.safetensors``), CLIP-L and T5-XXL in
transformers' keys (``clip_l.safetensors``, ``t5xxl_fp16.safetensors``); its all-in-one Flux checkpoints
hold those under ``model.diffusion_model.``, ``vae.``, ``text_encoders.clip_l.transformer.`` and
``text_encoders.t5xxl.transformer.``. ``save_flux_files`` and ``save_flux_checkpoint`` write a tiny Flux
folder that way (``flux_bfl_state_dict``: diffusers' Flux conversion run backwards; diffusers' own
converter assumes the real model's width, 3072, so a tiny file cannot go through it).

A Wan transformer is kept in Wan's original keys (Comfy's ``wan2.1_t2v_1.3B_fp16.safetensors``):
``wan_original_state_dict`` writes a WanTransformer3DModel's tensors so, and checks that diffusers' own
converter gives them back; ``sd3_mmdit_state_dict`` writes an SD3Transformer2DModel in Stability's original
MMDiT keys (``sd3.5_large.safetensors``), diffusers' SD3 conversion run backwards and checked the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = [
    "FLUX_FILE_NAMES",
    "FLUX_PREFIXES",
    "SD3_PREFIXES",
    "chroma_original_state_dict",
    "flux_bfl_state_dict",
    "ldm_state_dict",
    "ldm_vae_state_dict",
    "save_aligned",
    "save_flux_checkpoint",
    "save_flux_files",
    "save_sd3_checkpoint",
    "save_single_file",
    "sd3_mmdit_state_dict",
    "sd3_states",
    "wan22_vae_original_state_dict",
    "wan_original_state_dict",
    "wan_vae_original_state_dict",
    "z_image_original_state_dict",
]

# A few of the tensors real SD files carry beside the models (the training schedule, the
# text encoder's position ids): a loader must leave them alone.
_EXTRAS = {"alphas_cumprod": torch.linspace(0.99, 0.01, 1000), "model_ema.decay": torch.tensor(0.9999)}

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"), ("conv2", "out_layers.3"),
           ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
_VAE_ATTENTION = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))


def _rename(key: str, pairs) -> str:
    for new, old in pairs:
        key = key.replace(f".{new}.", f".{old}.")
    return key


def _unet_key(key: str, config: dict) -> str:
    """The LDM name of a diffusers UNet2DConditionModel tensor."""
    per_block = config["layers_per_block"] + 1
    parts = key.split(".")
    fixed = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
    head = ".".join(parts[:2]) if parts[0] in ("time_embedding", "add_embedding") else parts[0]
    if head in fixed:
        return key.replace(head, fixed[head], 1)
    if parts[0] == "mid_block":
        index = {"resnets.0": 0, "attentions.0": 1, "resnets.1": 2}[".".join(parts[1:3])]
        return _rename(f"middle_block.{index}.{'.'.join(parts[3:])}", _RESNET if parts[1] == "resnets" else ())
    block, kind, rest = int(parts[1]), parts[2], parts[3:]
    if parts[0] == "down_blocks":
        if kind == "downsamplers":  # down_blocks.i.downsamplers.0.conv.w
            return f"input_blocks.{(block + 1) * per_block}.0.op.{'.'.join(rest[2:])}"
        layer = 1 + block * per_block + int(rest[0])
        name = f"input_blocks.{layer}.{0 if kind == 'resnets' else 1}.{'.'.join(rest[1:])}"
        return _rename(name, _RESNET) if kind == "resnets" else name
    # up blocks have one layer more than down blocks; an upsampler follows the block's attention, if any
    if kind == "upsamplers":
        has_attention = "CrossAttn" in config["up_block_types"][block]
        return f"output_blocks.{block * per_block + per_block - 1}.{2 if has_attention else 1}.{'.'.join(rest[1:])}"
    layer = block * per_block + int(rest[0])
    name = f"output_blocks.{layer}.{0 if kind == 'resnets' else 1}.{'.'.join(rest[1:])}"
    return _rename(name, _RESNET) if kind == "resnets" else name


def _vae_tensor(key: str, tensor: torch.Tensor, config: dict) -> tuple[str, torch.Tensor]:
    """The LDM name (and shape: attention projections are 1x1 convolutions there) of an AutoencoderKL tensor."""
    levels = len(config["up_block_types"])
    parts = key.split(".")
    side = parts[0]
    if parts[1] == "conv_norm_out":
        return key.replace("conv_norm_out", "norm_out"), tensor
    if parts[1] == "mid_block":
        if parts[2] == "resnets":
            rest = ".".join(parts[4:]).replace("conv_shortcut", "nin_shortcut")
            return f"{side}.mid.block_{int(parts[3]) + 1}.{rest}", tensor
        rest = _rename("." + ".".join(parts[4:]), _VAE_ATTENTION).lstrip(".")
        if tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        return f"{side}.mid.attn_1.{rest}", tensor
    if parts[1] in ("down_blocks", "up_blocks"):
        block = int(parts[2])
        level, word = (block, "down") if parts[1] == "down_blocks" else (levels - 1 - block, "up")
        if parts[3] == "resnets":
            rest = ".".join(parts[5:]).replace("conv_shortcut", "nin_shortcut")
            return f"{side}.{word}.{level}.block.{parts[4]}.{rest}", tensor
        sampler = "downsample" if word == "down" else "upsample"
        return f"{side}.{word}.{level}.{sampler}.{'.'.join(parts[5:])}", tensor
    return key, tensor  # conv_in, conv_out, quant_conv, post_quant_conv keep their names


def _open_clip_state(encoder, *, skipped_layer: bool = False) -> dict[str, torch.Tensor]:
    """A CLIP text encoder's tensors in OpenCLIP's layout (SD 2's encoder, SDXL's bigG): q, k and v fused into
    one in_proj, the projection transposed. ``skipped_layer``: as SD 2's files, with the projection the model
    does not use and one layer more than it runs (it takes the penultimate layer's output)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    tables = DIFFUSERS_TO_LDM_MAPPING["openclip"]
    # transformers 5.6 flattened CLIPTextModel: put its names back under text_model. as the tables write them.
    inner = ("embeddings", "encoder", "final_layer_norm")
    state = {("text_model." + key if key.split(".")[0] in inner else key): value
             for key, value in encoder.state_dict().items()}
    out = {old: state[new].T if old == "text_projection" else state[new] for new, old in tables["layers"].items()
           if new in state}
    fused: dict[str, list] = {}
    for key, tensor in state.items():
        if not key.startswith("text_model.encoder.layers."):
            continue
        name = key
        for new, old in tables["transformer"].items():
            name = name.replace(new, old)
        for projection in ("q_proj", "k_proj", "v_proj"):
            if f".{projection}." in name:
                base, kind = name.split(f".{projection}.")
                fused.setdefault(f"transformer.{base}.in_proj_{kind}", [None] * 3)[("q_proj", "k_proj", "v_proj").index(
                    projection)] = tensor
                break
        else:
            out["transformer." + name] = tensor
    out.update({key: torch.cat(parts) for key, parts in fused.items()})
    if skipped_layer:
        hidden, last = encoder.config.hidden_size, encoder.config.num_hidden_layers - 1
        out["text_projection"] = torch.zeros(hidden, hidden)
        out["logit_scale"] = torch.tensor(4.6052)
        out.update({key.replace(f"resblocks.{last}.", f"resblocks.{last + 1}."): value.clone()
                    for key, value in out.items() if key.startswith(f"transformer.resblocks.{last}.")})
    return out


def ldm_vae_state_dict(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKL's tensors in the LDM key layout, as A1111's ``models/VAE`` files hold them."""
    config = dict(vae.config)
    return dict(_vae_tensor(key, tensor, config) for key, tensor in vae.state_dict().items())


# Where each family's file keeps its text encoders: (component, prefix, stored in OpenCLIP's layout).
_TEXT_ENCODERS = {
    "v1": (("text_encoder", "cond_stage_model.transformer.", False),),
    "v2": (("text_encoder", "cond_stage_model.model.", True),),
    "xl_base": (("text_encoder", "conditioner.embedders.0.transformer.", False),
                ("text_encoder_2", "conditioner.embedders.1.model.", True)),
    "xl_refiner": (("text_encoder_2", "conditioner.embedders.0.model.", True),),
}


def _family(pipe) -> str:
    """diffusers' name for the family of an SD 1.x, SD 2.x, SDXL or SDXL refiner pipeline's checkpoint (it tells
    SD 2 by its 1024-wide cross-attention)."""
    if getattr(pipe, "text_encoder", None) is None:
        return "xl_refiner"
    if getattr(pipe, "text_encoder_2", None) is not None:
        return "xl_base"
    return "v2" if pipe.unet.config.cross_attention_dim == 1024 else "v1"


def ldm_state_dict(pipe) -> dict[str, torch.Tensor]:
    """An SD 1.x, SD 2.x, SDXL or SDXL refiner pipeline's UNet, VAE and text encoders as one state dict in the
    LDM key layout."""
    out = {}
    unet_config = dict(pipe.unet.config)
    for key, tensor in pipe.unet.state_dict().items():
        out["model.diffusion_model." + _unet_key(key, unet_config)] = tensor
    out.update({"first_stage_model." + key: value for key, value in ldm_vae_state_dict(pipe.vae).items()})
    family = _family(pipe)
    for name, prefix, open_clip in _TEXT_ENCODERS[family]:
        encoder = getattr(pipe, name)
        if open_clip:
            state = _open_clip_state(encoder, skipped_layer=family == "v2")
        else:
            state = {("" if key.startswith("text_model.") else "text_model.") + key: tensor
                     for key, tensor in encoder.state_dict().items()}
            state["text_model.embeddings.position_ids"] = torch.arange(encoder.config.max_position_embeddings)[None]
        out.update({prefix + key: value for key, value in state.items()})
    return out


def save_single_file(folder: str | Path, path: str | Path, *, dtype: torch.dtype | None = None,
                     extras: bool = True) -> Path:
    """Write the SD 1.x, SD 2.x, SDXL or SDXL refiner diffusers folder ``folder`` as an all-in-one LDM
    checkpoint at ``path``.

    ``dtype`` stores the floating tensors in that dtype (published files are fp16); ``extras`` adds
    tensors real files carry beside the models. Raises AssertionError unless diffusers' converters
    give the folder's tensors back.
    """
    import diffusers
    from safetensors.torch import save_file

    folder, path = Path(folder), Path(path)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    if dtype is not None:
        pipe.to(dtype)
    state = ldm_state_dict(pipe)
    _check_round_trip(pipe, state)
    if extras:
        state.update(_EXTRAS)
    state = {key: tensor.contiguous() for key, tensor in state.items()}
    save_file(state, path, metadata={"format": "pt", "memfit.testing": json.dumps({"source": folder.name})})
    return path


def _check_round_trip(pipe, state: dict[str, torch.Tensor]) -> None:
    from diffusers.loaders.single_file_utils import (convert_ldm_clip_checkpoint, convert_ldm_unet_checkpoint,
                                                     convert_ldm_vae_checkpoint, convert_open_clip_checkpoint)

    converted = {"unet": convert_ldm_unet_checkpoint(state, dict(pipe.unet.config)),
                 "vae": convert_ldm_vae_checkpoint(state, dict(pipe.vae.config))}
    for name, prefix, open_clip in _TEXT_ENCODERS[_family(pipe)]:
        encoder = getattr(pipe, name)
        tensors = convert_open_clip_checkpoint(encoder, state, prefix=prefix) if open_clip else \
            convert_ldm_clip_checkpoint({key: value for key, value in state.items() if key.startswith(prefix)})
        # As diffusers' own single-file CLIP loading: the flattened CLIPTextModel has no text_model. level.
        converted[name] = tensors if hasattr(encoder, "text_model") else \
            {key.removeprefix("text_model."): value for key, value in tensors.items()}
    for name, tensors in converted.items():
        original = getattr(pipe, name).state_dict()
        layers = getattr(getattr(pipe, name).config, "num_hidden_layers", None)
        # Beside the model's: position ids, and the layer SD 2's encoder has but does not run.
        extra = [key for key in tensors.keys() - original.keys()
                 if not key.endswith("position_ids") and f"layers.{layers}." not in key]
        assert original.keys() <= tensors.keys() and not extra, (name, sorted(original.keys() - tensors.keys())[:5],
                                                                 extra[:5])
        for key, value in original.items():
            assert torch.equal(tensors[key], value), (name, key)


# -- Flux, as ComfyUI keeps it ------------------------------------------------------------------------

# diffusers' module names -> Black Forest Labs' (read off diffusers' convert_flux_transformer_checkpoint_to_diffusers).
_FLUX_TOP = {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
             "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
_FLUX_BLOCKS = {
    "transformer_blocks": ("double_blocks", {
        "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
        "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
        "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
        "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
        "ff_context.net.2": "txt_mlp.2", "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"},
        {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
         "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}),
    "single_transformer_blocks": ("single_blocks", {
        "norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
        "proj_out": "linear2"},
        {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}),
}


def _original_modulation(tensor: torch.Tensor) -> torch.Tensor:
    """A final-norm modulation of diffusers' (scale, shift) as the original layouts store it: (shift, scale)."""
    scale, shift = tensor.chunk(2)
    return torch.cat([shift, scale])


def flux_bfl_state_dict(transformer) -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel's tensors in Black Forest Labs' original keys: each double block's q, k and v
    fused in one ``qkv``, each single block's q, k, v and MLP input in ``linear1``, the final norm's modulation
    as (shift, scale), a norm's weight as ``scale``. Any width: works on the meta device too."""
    return _bfl_state(transformer.state_dict())


def _bfl_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, fused = {}, {}
    for key, tensor in state.items():
        path, _, leaf = key.rpartition(".")
        parts = path.split(".", 2)
        if parts[0] in _FLUX_BLOCKS:
            kind, renames, fusions = _FLUX_BLOCKS[parts[0]]
            head = f"{kind}.{parts[1]}."
            target = next(((name, members.index(parts[2])) for name, members in fusions.items()
                           if parts[2] in members), None)
            if target is not None:
                slots = fused.setdefault(f"{head}{target[0]}.{leaf}", [None] * len(fusions[target[0]]))
                slots[target[1]] = tensor
                continue
            old = renames[parts[2]]
            out[f"{head}{old}.{'scale' if old.endswith('_norm') else leaf}"] = tensor
        elif path == "norm_out.linear":
            out[f"final_layer.adaLN_modulation.1.{leaf}"] = _original_modulation(tensor)
        else:
            out[f"{_FLUX_TOP[path]}.{leaf}"] = tensor
    out.update({key: torch.cat(slots) for key, slots in fused.items()})
    return out


def _clip_l_state(encoder) -> dict[str, torch.Tensor]:
    """A CLIP-L text encoder as ComfyUI's clip_l.safetensors holds it: transformers' names under text_model."""
    state = {("" if key.startswith("text_model.") else "text_model.") + key: tensor
             for key, tensor in encoder.state_dict().items()}
    state["text_model.embeddings.position_ids"] = torch.arange(encoder.config.max_position_embeddings)[None]
    return state


def _t5_state(encoder) -> dict[str, torch.Tensor]:
    """A T5 encoder as t5xxl_fp16.safetensors holds it: transformers' names, the tied token embedding once."""
    return {key: tensor for key, tensor in encoder.state_dict().items() if key != "encoder.embed_tokens.weight"}


def _flux_states(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    return {"transformer": flux_bfl_state_dict(pipe.transformer), "vae": ldm_vae_state_dict(pipe.vae),
            "text_encoder": _clip_l_state(pipe.text_encoder), "text_encoder_2": _t5_state(pipe.text_encoder_2)}


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({key: tensor.contiguous() for key, tensor in state.items()}, path)
    return path


# The names ComfyUI's models folder gives Flux's split files.
FLUX_FILE_NAMES = {"transformer": "flux1-dev.safetensors", "vae": "ae.safetensors", "text_encoder": "clip_l.safetensors",
                   "text_encoder_2": "t5xxl_fp16.safetensors"}
# Where ComfyUI's all-in-one Flux checkpoints keep each model.
FLUX_PREFIXES = {"transformer": "model.diffusion_model.", "vae": "vae.", "text_encoder": "text_encoders.clip_l.transformer.",
                 "text_encoder_2": "text_encoders.t5xxl.transformer."}


def save_flux_files(folder: str | Path, out: str | Path) -> dict[str, Path]:
    """Write the tiny Flux diffusers folder ``folder`` as ComfyUI's split files in ``out``; component -> file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return {name: _save(state, out / FLUX_FILE_NAMES[name]) for name, state in _flux_states(Path(folder)).items()}


def save_flux_checkpoint(folder: str | Path, path: str | Path) -> Path:
    """Write the tiny Flux diffusers folder ``folder`` as one all-in-one checkpoint in ComfyUI's prefixes."""
    states = _flux_states(Path(folder))
    return _save({FLUX_PREFIXES[name] + key: tensor for name, state in states.items() for key, tensor in state.items()},
                 Path(path))


# -- Wan, in its original keys -----------------------------------------------------------------------

# diffusers' names -> Wan's, in this order (read off diffusers' convert_wan_transformer_to_diffusers; its cross
# attention's norm is diffusers' norm2 and Wan's norm3).
_WAN_RENAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"), ("attn2", "cross_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), (".norm2.", ".norm3."),
    ("proj_out", "head.head"),
)


def wan_original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """A WanTransformer3DModel's tensors in Wan's original keys (``blocks.0.self_attn.q.weight``). Raises
    AssertionError unless diffusers' converter gives the model's own tensors back."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    out = {}
    for key, tensor in transformer.state_dict().items():
        name = key
        if name == "scale_shift_table":
            name = "head.modulation"
        elif name.endswith(".scale_shift_table"):
            name = name.removesuffix("scale_shift_table") + "modulation"
        for new, old in _WAN_RENAMES:
            name = name.replace(new, old)
        out[name] = tensor
    back = convert_wan_transformer_to_diffusers(dict(out))
    original = transformer.state_dict()
    assert back.keys() == original.keys(), sorted(back.keys() ^ original.keys())[:5]
    assert all(back[key] is original[key] or torch.equal(back[key], original[key]) for key in original)
    return out


# -- Wan 2.1's VAE (and Qwen-Image's), in Wan's original keys ----------------------------------------------

# diffusers' names -> Wan's (read off diffusers' convert_wan_vae_to_diffusers).
_WAN_VAE_TOP = {"quant_conv": "conv1", "post_quant_conv": "conv2", "encoder.conv_in": "encoder.conv1",
                "decoder.conv_in": "decoder.conv1", "encoder.norm_out": "encoder.head.0",
                "encoder.conv_out": "encoder.head.2", "decoder.norm_out": "decoder.head.0",
                "decoder.conv_out": "decoder.head.2"}
_WAN_VAE_INNER = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                  "conv_shortcut": "shortcut"}


def wan_vae_original_state_dict(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKLWan's (or AutoencoderKLQwenImage's) tensors in Wan 2.1's original keys, as ComfyUI's
    wan_2.1_vae.safetensors and qwen_image_vae.safetensors hold them: the decoder's up blocks flattened into one
    list of blocks (each up block's residual blocks, then its upsampler), the middle as residual, attention,
    residual."""
    per_block = vae.config.num_res_blocks + 2
    return {_wan_vae_key(key, per_block): tensor for key, tensor in vae.state_dict().items()}


def _wan_vae_key(key: str, per_block: int) -> str:
    """The Wan 2.1 name of an AutoencoderKLWan tensor whose decoder up blocks hold ``per_block`` entries."""
    path, _, leaf = key.rpartition(".")
    parts = path.split(".")
    if path in _WAN_VAE_TOP:
        name = _WAN_VAE_TOP[path]
    elif parts[1] == "mid_block":
        index = 1 if parts[2] == "attentions" else 2 * int(parts[3])
        name = ".".join([parts[0], "middle", str(index), *[_WAN_VAE_INNER.get(p, p) for p in parts[4:]]])
    elif parts[1] == "down_blocks":
        name = ".".join([parts[0], "downsamples", parts[2], *[_WAN_VAE_INNER.get(p, p) for p in parts[3:]]])
    elif parts[1] == "up_blocks":
        up, kind, within, rest = int(parts[2]), parts[3], int(parts[4]), parts[5:]
        index = up * per_block + (per_block - 1 if kind == "upsamplers" else within)
        inner = rest if kind == "upsamplers" else [_WAN_VAE_INNER.get(p, p) for p in rest]
        name = ".".join([parts[0], "upsamples", str(index), *inner])
    else:
        raise AssertionError(f"no Wan name for {key}")
    return f"{name}.{leaf}"


def wan22_vae_original_state_dict(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKLWan of Wan 2.2's structure (is_residual: the TI2V-5B's) in the original keys, as the Wan
    repository's Wan2.2_VAE.pth and ComfyUI's wan2.2_vae.safetensors hold them: each level a block of its own whose one
    list holds its residual blocks, then its resampler (``encoder.downsamples.0.downsamples.1.resample.1.weight``,
    ``decoder.upsamples.0.upsamples.2.time_conv.weight``); the middle, heads and quant convolutions as Wan 2.1's."""
    blocks = {"down_blocks": ("downsamples", "downsampler", vae.config.num_res_blocks),
              "up_blocks": ("upsamples", "upsampler", vae.config.num_res_blocks + 1)}
    out = {}
    for key, tensor in vae.state_dict().items():
        parts = key.split(".")
        if parts[1] not in blocks:
            out[_wan_vae_key(key, 0)] = tensor
            continue
        listed, sampler, resampler_index = blocks[parts[1]]
        head = f"{parts[0]}.{listed}.{parts[2]}.{listed}"
        if parts[3] == sampler:
            out[f"{head}.{resampler_index}.{'.'.join(parts[4:])}"] = tensor
        else:  # resnets.J.<inner>
            path, leaf = ".".join(parts[5:-1]), parts[-1]
            out[f"{head}.{parts[4]}.{_WAN_VAE_INNER.get(path, path)}.{leaf}"] = tensor
    return out


# -- SD3, in Stability's MMDiT keys --------------------------------------------------------------------

# diffusers' module names -> Stability's (read off diffusers' convert_sd3_transformer_checkpoint_to_diffusers).
_SD3_TOP = {"pos_embed.proj": "x_embedder.proj", "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
            "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
            "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
            "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "proj_out": "final_layer.linear",
            "context_embedder": "context_embedder"}
_SD3_BLOCK = {"norm1.linear": "x_block.adaLN_modulation.1", "norm1_context.linear": "context_block.adaLN_modulation.1",
              "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
              "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
              "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
              "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
              "attn2.to_out.0": "x_block.attn2.proj", "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
              "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2"}
_SD3_FUSED = {"attn.to_q": ("x_block.attn.qkv", 0), "attn.to_k": ("x_block.attn.qkv", 1),
              "attn.to_v": ("x_block.attn.qkv", 2), "attn2.to_q": ("x_block.attn2.qkv", 0),
              "attn2.to_k": ("x_block.attn2.qkv", 1), "attn2.to_v": ("x_block.attn2.qkv", 2),
              "attn.add_q_proj": ("context_block.attn.qkv", 0), "attn.add_k_proj": ("context_block.attn.qkv", 1),
              "attn.add_v_proj": ("context_block.attn.qkv", 2)}


def sd3_mmdit_state_dict(transformer) -> dict[str, torch.Tensor]:
    """An SD3Transformer2DModel's tensors in Stability's MMDiT keys: each side's q, k and v fused into one ``qkv``,
    the last block's text-side modulation and the final norm's stored as (shift, scale). Raises AssertionError
    unless diffusers' converter gives the model's own tensors back."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    last = transformer.config.num_layers - 1
    out, fused = {}, {}
    for key, tensor in transformer.state_dict().items():
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = tensor
            continue
        path, _, leaf = key.rpartition(".")
        if path.startswith("transformer_blocks."):
            _, index, inner = path.split(".", 2)
            head = f"joint_blocks.{index}."
            if inner in _SD3_FUSED:
                name, slot = _SD3_FUSED[inner]
                fused.setdefault(f"{head}{name}.{leaf}", [None] * 3)[slot] = tensor
                continue
            if inner == "norm1_context.linear" and int(index) == last:
                tensor = _original_modulation(tensor)
            out[f"{head}{_SD3_BLOCK[inner]}.{leaf}"] = tensor
        elif path == "norm_out.linear":
            out[f"final_layer.adaLN_modulation.1.{leaf}"] = _original_modulation(tensor)
        else:
            out[f"{_SD3_TOP[path]}.{leaf}"] = tensor
    out.update({key: torch.cat(slots) for key, slots in fused.items()})
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(out))
    original = transformer.state_dict()
    assert back.keys() == original.keys(), sorted(back.keys() ^ original.keys())[:5]
    assert all(torch.equal(back[key], original[key]) for key in original)
    return out


# -- SD3 as Stability keeps it, Chroma and Z-Image in their original keys -------------------------------

# Where Stability's all-in-one SD3 checkpoints keep each model.
SD3_PREFIXES = {"transformer": "model.diffusion_model.", "vae": "first_stage_model.",
                "text_encoder": "text_encoders.clip_l.transformer.", "text_encoder_2": "text_encoders.clip_g.transformer.",
                "text_encoder_3": "text_encoders.t5xxl.transformer."}


def _clip_state(encoder, *, projection: bool) -> dict[str, torch.Tensor]:
    """A CLIPTextModelWithProjection in transformers' names, its projection kept (CLIP-G) or left out, as
    Stability's files leave CLIP-L's (SD3 runs it as the identity)."""
    state = {}
    for key, tensor in encoder.state_dict().items():
        if key == "text_projection.weight":
            if projection:
                state[key] = tensor
            continue
        state[("" if key.startswith("text_model.") else "text_model.") + key] = tensor
    return state


def sd3_states(folder: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The tiny SD3 diffusers folder ``folder``'s models as Stability's files hold them, by component."""
    import diffusers

    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(folder)
    return {"transformer": sd3_mmdit_state_dict(pipe.transformer), "vae": ldm_vae_state_dict(pipe.vae),
            "text_encoder": _clip_state(pipe.text_encoder, projection=False),
            "text_encoder_2": _clip_state(pipe.text_encoder_2, projection=True),
            "text_encoder_3": _t5_both_names(pipe.text_encoder_3)}


def _t5_both_names(encoder) -> dict[str, torch.Tensor]:
    """A T5 encoder with its tied token embedding under both names, as diffusers' single-file loading needs it (it
    does not tie them)."""
    state = encoder.state_dict()
    state["encoder.embed_tokens.weight"] = state["shared.weight"].clone()
    return state


def save_aligned(state: dict[str, torch.Tensor], path: str | Path, *, like: str | Path | None = None) -> Path:
    """``state`` as a safetensors file in which every tensor of a whole number of 64-byte lines starts on one.

    A weight read in place from a file is used where it lies, and a CPU matmul may add in another order when
    its operand is not aligned (one bit in the last place); a folder's file places its tensors by chance. The
    files here are compared with folders bit for bit, so their matrices lie aligned as a model loaded to memory
    holds them: those first, the header padded with spaces (which the format allows), the odd-sized rest after.
    ``like``: a safetensors file read in place (a diffusers folder's, whose loading maps it too): the data starts
    at the same place in a 64-byte line as there, so where every tensor is a whole number of lines (the tiny
    models at scale 4) each lies as the folder's does.
    """
    from safetensors.torch import _TYPES

    names = {dtype: name for name, dtype in _TYPES.items()}
    tensors = {key: tensor.detach().contiguous() for key, tensor in state.items()}
    size = {key: tensor.numel() * tensor.element_size() for key, tensor in tensors.items()}
    order = sorted(tensors, key=lambda key: (size[key] % 64 != 0, key))
    header, offset = {}, 0
    for key in order:
        tensor = tensors[key]
        header[key] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size[key]]}
        offset += size[key]
    text = json.dumps(header, separators=(",", ":")).encode()
    start = 0
    if like is not None:
        with Path(like).open("rb") as handle:
            start = 8 + int.from_bytes(handle.read(8), "little")
    text += b" " * ((start - 8 - len(text)) % 64)
    path = Path(path)
    with path.open("wb") as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        for key in order:
            handle.write(tensors[key].reshape(-1).view(torch.uint8).numpy().tobytes())
    return path


def save_sd3_checkpoint(folder: str | Path, path: str | Path) -> Path:
    """Write the tiny SD3 diffusers folder ``folder`` as one all-in-one checkpoint in Stability's layout
    (``sd3_medium_incl_clips_t5xxlfp16.safetensors``): SD3_PREFIXES, CLIP-L without its projection."""
    return save_aligned({SD3_PREFIXES[name] + key: tensor for name, state in sd3_states(folder).items()
                  for key, tensor in state.items()}, Path(path))


def chroma_original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """A ChromaTransformer2DModel's tensors in Chroma's original keys: Flux's Black Forest Labs keys (as
    flux_bfl_state_dict writes them) and the approximator's ``distilled_guidance_layer.layers.0.in_layer``,
    ``norms.0.scale``. Any width: works on the meta device too (diffusers' converter assumes the real width)."""
    state = transformer.state_dict()
    approximator = {}
    for key, tensor in state.items():
        if key.startswith("distilled_guidance_layer."):
            name = key.replace(".linear_1.", ".in_layer.").replace(".linear_2.", ".out_layer.")
            approximator[name.removesuffix(".weight") + ".scale" if ".norms." in name else name] = tensor
    rest = {key: tensor for key, tensor in state.items() if not key.startswith("distilled_guidance_layer.")}
    return {**_bfl_state(rest), **approximator}


# diffusers' names -> Z-Image's (read off diffusers' convert_z_image_transformer_checkpoint_to_diffusers).
_Z_IMAGE_RENAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
                    (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
                    (".attention.norm_q.", ".attention.q_norm."))


def z_image_original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """A ZImageTransformer2DModel's tensors in Z-Image's original keys (each attention's q, k and v fused in one
    ``qkv``). Raises AssertionError unless diffusers' converter gives the model's own tensors back."""
    from diffusers.loaders.single_file_utils import (
        convert_z_image_transformer_checkpoint_to_diffusers,
    )

    out, fused = {}, {}
    for key, tensor in transformer.state_dict().items():
        head, _, projection = key.rpartition(".attention.")
        if head and projection in ("to_q.weight", "to_k.weight", "to_v.weight"):
            fused.setdefault(f"{head}.attention.qkv.weight", [None] * 3)["qkv".index(projection[3])] = tensor
            continue
        for new, old in _Z_IMAGE_RENAMES:
            key = key.replace(new, old)
        out[key] = tensor
    out.update({key: torch.cat(slots) for key, slots in fused.items()})
    back = convert_z_image_transformer_checkpoint_to_diffusers(dict(out))
    original = transformer.state_dict()
    assert back.keys() == original.keys(), sorted(back.keys() ^ original.keys())[:5]
    assert all(torch.equal(back[key], original[key]) for key in original)
    return out
