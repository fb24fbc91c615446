"""Sizing without weights: build a component on the ``meta`` device from its config and measure it.

A meta model has shapes but no storage, so building even a 12B-parameter transformer takes
milliseconds and no memory. The meta model lives only inside ``_count_blocks``: it is never
returned, never attached to a live module tree and never moved with ``.to()`` (a meta
"template" registered as a submodule breaks ``.to()`` and copies). Callers get
plain frozen dataclasses.

Blocks are the unit the planner places and the executor streams. A component is split into:
  * the elements of its ``nn.ModuleList``s (``down_blocks.0``, ``transformer_blocks.7``,
    ``text_model.encoder.layers.3``), found at any depth;
  * an element larger than ``max_block_fraction`` of the component that itself holds ModuleLists
    is split again (an SDXL ``down_blocks.2`` holds 20 transformer layers, ~1 GB at fp16: far
    too coarse to stream under a 4 GiB budget), its own loose children becoming ``<path>.rest``;
  * everything else at a level (``conv_in``, ``time_embedding``, ``norm_out`` ...) is grouped into
    one ``rest`` block for that level.
Blocks partition the parameters: every parameter (tied ones once) is in exactly one block. Their
order is module registration order, which is the execution order for most diffusers and
transformers models but not all (a UNet up block registers ``attentions`` before ``resnets`` and
runs them interleaved; ``rest`` mixes the first and last layers). The executor learns the true
order on the first forward; this static order is only for planning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Mapping

from memfit.errors import MemfitError

__all__ = [
    "BlockSize",
    "ComponentSize",
    "DEFAULT_MAX_BLOCK_FRACTION",
    "DTYPE_BYTES",
    "DirectTensors",
    "activation_elements",
    "activation_estimate",
    "build_on_meta",
    "diffusers_module",
    "dtype_bytes",
    "is_model_class",
    "is_under",
    "measure_component",
    "measure_module",
    "split_blocks",
]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

DEFAULT_MAX_BLOCK_FRACTION = 1 / 16


@dataclasses.dataclass(frozen=True)
class BlockSize:
    """One streamable unit of a component: its dotted module path, bytes at the measured dtype."""

    name: str
    bytes: int
    param_count: int


@dataclasses.dataclass(frozen=True)
class ComponentSize:
    """What a component weighs at ``dtype``, block by block in static execution order."""

    name: str
    class_name: str
    dtype: str
    total_bytes: int
    param_count: int
    blocks: tuple[BlockSize, ...]
    # The largest weight stored smaller than it runs (memfit.quant), dequantized at ``dtype``: its layer's
    # forward holds it beside the stage's activations.
    scratch_bytes: int = 0

    def select(self, prefixes: tuple[str, ...] | None) -> "ComponentSize":
        """The part of this component under the given module paths (e.g. ("decoder",) of a VAE)."""
        if not prefixes:
            return self
        kept = tuple(b for b in self.blocks if any(is_under(b.name, p) for p in prefixes))
        if not kept:
            raise MemfitError(
                f"Component {self.name!r} ({self.class_name}) has no blocks under {list(prefixes)}; "
                f"its blocks start with {sorted({b.name.split('.')[0] for b in self.blocks})}."
            )
        return dataclasses.replace(
            self,
            total_bytes=sum(b.bytes for b in kept),
            param_count=sum(b.param_count for b in kept),
            blocks=kept,
        )


def is_under(block_name: str, prefix: str) -> bool:
    return block_name == prefix or block_name.startswith(prefix + ".")


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise MemfitError(f"Unknown dtype {dtype!r}; use one of fp32, bf16, fp16.") from None


def measure_component(
    name: str,
    library: str,
    class_name: str,
    config: Mapping[str, Any],
    dtype: str = "bf16",
    *,
    max_block_fraction: float = DEFAULT_MAX_BLOCK_FRACTION,
) -> ComponentSize:
    """Size the component ``name`` (library "diffusers" or "transformers", class ``class_name``)
    built from ``config`` (the contents of its config.json), at ``dtype``, without any weights.

    Floating-point parameters and buffers count at ``dtype`` (that is what the loaded model will
    hold); integer buffers (position ids) keep their own width.
    """
    item_size = dtype_bytes(dtype)
    config_json = json.dumps(dict(config), sort_keys=True, default=str)
    counts = _count_blocks(library, class_name, config_json, max_block_fraction)
    blocks = tuple(
        BlockSize(name=block, bytes=float_elems * item_size + other_bytes, param_count=params)
        for block, float_elems, other_bytes, params in counts
    )
    return ComponentSize(
        name=name,
        class_name=class_name,
        dtype=dtype,
        total_bytes=sum(b.bytes for b in blocks),
        param_count=sum(b.param_count for b in blocks),
        blocks=blocks,
    )


def measure_module(name: str, module, dtype: str = "bf16", *,
                   max_block_fraction: float = DEFAULT_MAX_BLOCK_FRACTION) -> ComponentSize:
    """measure_component for a module already built (on the meta device): a component whose weights are not
    those its config gives, e.g. stored quantized (memfit.quant), which count their stored bytes."""
    from memfit.quant.formats import dequantized_elements

    item_size = dtype_bytes(dtype)
    blocks = tuple(BlockSize(name=block, bytes=float_elems * item_size + other_bytes, param_count=params)
                   for block, float_elems, other_bytes, params in _module_blocks(module, max_block_fraction))
    scratch = max((dequantized_elements(p) for p in module.parameters()), default=0) * item_size
    return ComponentSize(name=name, class_name=type(module).__name__, dtype=dtype,
                         total_bytes=sum(b.bytes for b in blocks), param_count=sum(b.param_count for b in blocks),
                         blocks=blocks, scratch_bytes=scratch)


# Cached on (library, class, config text): building is cheap but not free, and the CLI, the
# planner tests and the archs check all ask about the same few architectures. The cache holds
# plain tuples only, never the meta module.
@functools.lru_cache(maxsize=64)
def _count_blocks(
    library: str, class_name: str, config_json: str, max_block_fraction: float
) -> tuple[tuple[str, int, int, int], ...]:
    return _module_blocks(build_on_meta(library, class_name, json.loads(config_json)), max_block_fraction)


def _module_blocks(module, max_block_fraction: float) -> tuple[tuple[str, int, int, int], ...]:
    total_params = sum(p.numel() for p in module.parameters())
    threshold = max(1, int(total_params * max_block_fraction))
    seen: set[int] = set()  # ids of tensors already counted: tied weights count once
    out: list[tuple[str, int, int, int]] = []
    for block_name, modules in split_blocks(module, "", threshold):
        out.append((block_name, *_tensor_sizes(modules, seen)))
    return tuple(out)


def is_model_class(library: str, class_name: str) -> bool:
    """True when ``library.class_name`` is a torch module memfit can size (not a tokenizer or scheduler)."""
    try:
        _resolve_class(library, class_name)
    except MemfitError:
        return False
    return True


def build_on_meta(library: str, class_name: str, config: dict):
    """``library.class_name`` built from ``config`` on the meta device: its shapes, no data."""
    import torch

    cls = _resolve_class(library, class_name)
    config = {k: v for k, v in config.items() if not k.startswith("_") or k == "_name_or_path"}
    try:
        with torch.device("meta"):
            if diffusers_module(library) is not None:
                return cls.from_config(config)
            hf_config = cls.config_class.from_dict(config)
            return cls._from_config(hf_config)
    except Exception as exc:  # the libraries raise many types for a bad config; name the class
        raise MemfitError(
            f"Could not build {library}.{class_name} from its config ({type(exc).__name__}: {exc}). "
            "Check that config.json belongs to this class and that the installed "
            f"{library} version supports it."
        ) from exc


def _resolve_class(library: str, class_name: str):
    import importlib

    import torch

    module = diffusers_module(library) or (library if library == "transformers" else None)
    if module is None:
        raise MemfitError(
            f"Cannot size a {library!r} component ({class_name}); memfit sizes diffusers and transformers models."
        )
    cls = getattr(importlib.import_module(module), class_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        package = module.split(".")[0]
        raise MemfitError(
            f"{library} has no model class {class_name!r} (installed {package} "
            f"{importlib.import_module(package).__version__}); upgrade {package} or fix the class name."
        )
    return cls


def diffusers_module(library: str) -> str | None:
    """The module of diffusers' own code that model_index.json's ``library`` names: "diffusers", or one of its
    pipeline packages, where diffusers keeps a pipeline's own components (LTX-2's "ltx2": its text connectors and
    vocoder), as diffusers' from_pretrained resolves it; None for any other name."""
    if library == "diffusers":
        return library
    import diffusers.pipelines

    return f"diffusers.pipelines.{library}" if library.isidentifier() and hasattr(diffusers.pipelines, library) else None


def split_blocks(module, prefix: str, threshold: int):
    """Yield (block name, [modules]) in registration order; see the module docstring for the rules."""
    import torch

    loose = []
    for child_name, child in module.named_children():
        path = prefix + child_name
        if isinstance(child, torch.nn.ModuleList):
            for index, element in enumerate(child):
                if element is None:  # e.g. UNetMidBlock2D keeps None where attention is disabled
                    continue
                yield from _element_blocks(element, f"{path}.{index}", threshold)
        elif _holds_module_list(child) and _param_count(child) > threshold:
            yield from split_blocks(child, path + ".", threshold)
        else:
            loose.append(child)
    # Parameters registered directly on this module (e.g. a learned pad token) travel with "rest".
    direct = DirectTensors(module)
    if loose or direct.has_any():
        yield (prefix + "rest", loose + [direct])


def _element_blocks(element, path: str, threshold: int):
    if _holds_module_list(element) and _param_count(element) > threshold:
        yield from split_blocks(element, path + ".", threshold)
    else:
        yield (path, [element])


def _holds_module_list(module) -> bool:
    import torch

    return any(isinstance(m, torch.nn.ModuleList) for m in module.modules() if m is not None)


def _param_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


class DirectTensors:
    """The parameters and buffers a module registers itself, not through a child."""

    def __init__(self, module):
        self.module = module

    def has_any(self) -> bool:
        return any(True for _ in self.tensors())

    def tensors(self):
        yield from ((t, True) for t in self.module.parameters(recurse=False))
        yield from ((t, False) for t in self.module.buffers(recurse=False))


def _tensor_sizes(modules, seen: set[int]) -> tuple[int, int, int]:
    """(floating-point elements, bytes of other tensors, parameter count) not counted before."""
    float_elems = other_bytes = params = 0
    for tensor, is_param in _all_tensors(modules):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.is_floating_point():
            float_elems += tensor.numel()
        else:
            other_bytes += tensor.numel() * tensor.element_size()
        if is_param:
            params += tensor.numel()
    return float_elems, other_bytes, params


def _all_tensors(modules):
    for module in modules:
        if isinstance(module, DirectTensors):
            yield from module.tensors()
            continue
        yield from ((t, True) for t in module.parameters())
        # Non-persistent buffers (rotary tables) are rebuilt at load time but still occupy the
        # device, so they count.
        yield from ((t, False) for t in module.buffers())


# --- activations --------------------------------------------------------------------------------

# Per kind: how many tensors the size of the shape model's feature map are alive at the peak, plus
# workspace that does not scale with it. Calibrated on real-size SD 1.5 (fp32) and SDXL (bf16)
# components, 256 and 512 px, batch 1 and 2 (benchmarks/calibrate_activations.py; measured peaks,
# fits and each estimate's error in docs/activation_calibration.md). "transformer" has no real-size
# measurement yet (Flux, Lumina2, CogView4 did not fit this machine's time budget): a first guess.
# vae_decoder_banded's SDXL point was measured before the banded decode freed up-block inputs early
# and trimmed its heap per layer (it can only have dropped since), so that fit errs high for SDXL.
ACTIVATION_FACTORS = {
    "unet": 2.24,
    "unet_chunked": 1.58,
    "transformer": 4.0,
    "vae_decoder": 7.42,
    "vae_decoder_banded": 2.14,
    "text_encoder": 6.84,
    # What a family's encode keeps of the text encoder's outputs (PipelineAdapter.kept_text_elements): counted, not fitted.
    "text_output": 1.0,
}

# Workspace that does not scale with the feature maps (kernels' scratch buffers, attention blocks).
ACTIVATION_OFFSETS = {
    "unet": 59 * 2**20,
    "unet_chunked": 122 * 2**20,
    "transformer": 0,
    "vae_decoder": 22 * 2**20,
    "vae_decoder_banded": 210 * 2**20,
    "text_encoder": 0,
    "text_output": 0,
}

# Flux packs 2x2 latent patches into 64 channels outside the model, so its config says
# patch_size=1 although each token covers 2x2 latent pixels.
_PACKED_PATCH = {"FluxTransformer2DModel": 2}


# Video VAEs whose decoder runs every frame at once (no frame-by-frame cache, no tiling unless asked): the
# widest activation is the whole video at full resolution, times its last up block's channels.
WHOLE_VIDEO_DECODERS = ("AutoencoderKLHunyuanVideo15", "AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")


def activation_estimate(
    kind: str,
    config: Mapping[str, Any],
    *,
    width: int = 1024,
    height: int = 1024,
    batch: int = 1,
    dtype: str = "bf16",
    vae_scale: int = 8,
    text_tokens: int = 512,
    class_name: str = "",
    frames: int = 1,
) -> int:
    """A first estimate of the peak activation bytes of one forward pass.

    kind is "unet", "unet_chunked", "transformer", "vae_decoder", "vae_decoder_banded" or "text_encoder"; ``config`` is the component's
    config.json; width/height are the *image* size in pixels; ``batch`` is the batch the model
    really sees (2 when classifier-free guidance batches cond and uncond); ``frames`` the latent
    frames a video transformer sees at once, and a video VAE decodes (1 for images).

    Model: peak = factor[kind] * batch * dtype bytes * widest activation + offset[kind], where the widest
    activation is, per kind:
      unet:         max over resolution levels of tokens * channels * (4 with attention for the
                    GEGLU feed-forward's 8x-wide hidden / 2 with SDPA's O(n) memory, else 1), plus the
                    skip connections the down path keeps for the up path;
      unet_chunked: the same with the attention levels' widest tensor at 1x (memfit.run.chunked_attention
                    runs the attention and feed-forward hidden layers over chunks of tokens);
      transformer:  (image tokens + text tokens) * hidden size * 4 (feed-forward width);
      vae_decoder:  width * height * block_out_channels[0] (the full-resolution last up block); a
                    video VAE: that for the frames of one latent frame, plus the whole output video (for
                    every frame at once where the decoder runs them together: WHOLE_VIDEO_DECODERS);
      text_encoder: text_tokens * max(hidden size, intermediate size).
    Attention is assumed to run through a memory-efficient kernel (SDPA), so no n^2 score matrix
    is counted. Factors and offsets are calibrated on measured runs (ACTIVATION_FACTORS,
    ACTIVATION_OFFSETS; docs/activation_calibration.md); vae_decoder_banded is the banded decode
    of memfit.run.banded_decode.
    """
    if kind not in ACTIVATION_FACTORS:
        raise MemfitError(f"Unknown activation kind {kind!r}; use one of {sorted(ACTIVATION_FACTORS)}.")
    if width <= 0 or height <= 0 or batch <= 0:
        raise MemfitError(f"Width, height and batch must be positive, got {width}x{height}, batch {batch}.")
    elems = activation_elements(kind, config, width=width, height=height, vae_scale=vae_scale,
                                text_tokens=text_tokens, class_name=class_name, frames=frames)
    workspace = _conv_workspace(config, class_name) if kind.startswith("vae_decoder") else 0
    return int(ACTIVATION_FACTORS[kind] * batch * dtype_bytes(dtype) * elems + ACTIVATION_OFFSETS[kind] + workspace)


def _conv_workspace(config, class_name: str) -> int:
    """What a VAE's decode holds beyond its feature maps, where that is larger than they are at small sizes.

    HunyuanVideo 1.5's VAE: the first up block's upsampler is a 3D conv from the widest channels to 8 times them
    (2x2 pixels and 2 frames folded into channels), 226M weights at real size. On the CPU its call held 0.84-1.69 GiB
    beyond the feature maps, in fp32 and in bf16 alike (measured at 64-128 pixels, 9 frames: once or twice that
    weight in fp32), which the shape model misses: counted as twice its weight in fp32.
    """
    if class_name != "AutoencoderKLHunyuanVideo15":
        return 0
    widest = max(config.get("block_out_channels") or (1024,))
    return 2 * widest * (8 * widest) * 27 * DTYPE_BYTES["fp32"]


def activation_elements(kind: str, config: Mapping[str, Any], *, width: int, height: int, vae_scale: int = 8,
                        text_tokens: int = 512, class_name: str = "", frames: int = 1) -> int:
    """The shape model's element count for one sample (what ACTIVATION_FACTORS multiply)."""
    return {
        "unet": _unet_elems,
        "unet_chunked": functools.partial(_unet_elems, chunked=True),
        "transformer": _transformer_elems,
        "vae_decoder": _vae_decoder_elems,
        "vae_decoder_banded": _vae_decoder_elems,
        "text_encoder": _text_encoder_elems,
        "text_output": _text_output_elems,
    }[kind](config, width=width, height=height, vae_scale=vae_scale, text_tokens=text_tokens, class_name=class_name,
             frames=frames)


def _unet_elems(config, *, width, height, vae_scale, chunked=False, **_):
    channels = list(config.get("block_out_channels", (320, 640, 1280, 1280)))
    down_types = list(config.get("down_block_types", ()))
    layers = config.get("layers_per_block", 2)
    tokens0 = (width // vae_scale) * (height // vae_scale)
    widest = skips = 0
    for level, c in enumerate(channels):
        tokens = tokens0 // (4**level)
        has_attention = level < len(down_types) and "CrossAttn" in down_types[level]
        widest = max(widest, tokens * c * (4 if has_attention and not chunked else 1))
        skips += tokens * c * (layers + 1)
    return widest + skips


def _transformer_elems(config, *, width, height, vae_scale, text_tokens, class_name, frames=1, **_):
    patch = _PACKED_PATCH.get(class_name, config.get("patch_size", 2))
    if isinstance(patch, (list, tuple)):  # a video transformer's (time, height, width) patch
        frames = -(-frames // patch[0])
        patch = patch[-1]
    image_tokens = frames * (width // vae_scale // patch) * (height // vae_scale // patch)
    hidden = (config.get("hidden_size") or config.get("dim")  # Z-Image's transformer names its width dim
              or config.get("num_attention_heads", 24) * config.get("attention_head_dim", 128))
    return (image_tokens + text_tokens) * hidden * 4


def _vae_decoder_elems(config, *, width, height, frames=1, class_name="", **_):
    channels = config.get("block_out_channels") or (config.get("base_dim", 128),)
    if frames == 1:
        return width * height * channels[0]
    if class_name in ("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video"):  # LTX-2's decoder is LTX-Video's design
        return _ltx_decoder_elems(config, width=width, height=height, frames=frames)
    video_frames = _decoded_frames(config, class_name, frames)
    if class_name in WHOLE_VIDEO_DECODERS:
        return width * height * video_frames * (channels[0] + 3)
    # A video VAE decodes a latent frame at a time (its temporal ratio's video frames, widest at
    # full resolution) but returns the whole video at once.
    return width * height * (channels[0] * _temporal_ratio(config, class_name) + 3 * video_frames)


def _decoded_frames(config: Mapping[str, Any], class_name: str, latent_frames: int) -> int:
    """The video frames a video VAE of ``class_name`` decodes ``latent_frames`` latent frames into."""
    return (latent_frames - 1) * _temporal_ratio(config, class_name) + 1


def _temporal_ratio(config, class_name: str) -> int:
    if class_name in ("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video"):
        scaling = config.get("spatio_temporal_scaling", (True, True, True, False))
        return int(config.get("temporal_compression_ratio")
                   or config.get("patch_size_t", 1) * 2 ** sum(bool(flag) for flag in scaling))
    return int(config.get("scale_factor_temporal") or config.get("temporal_compression_ratio") or 4)


def _ltx_decoder_elems(config, *, width, height, frames):
    """LTX-Video's VAE (and LTX-2's) decodes every frame at once; its last up block runs at 1/patch_size of each side (the decoder
    unpatchifies its output), so its widest activation is that block's channels over patch_size**2 per output pixel."""
    channels = (config.get("decoder_block_out_channels") or config.get("block_out_channels") or (128,))[0]
    patch = int(config.get("patch_size", 4))
    return width * height * _decoded_frames(config, "AutoencoderKLLTXVideo", frames) * (channels / patch**2 + 3)


def _text_output_elems(config, *, text_tokens, **_):
    return config["elements_per_token"] * text_tokens


def _text_encoder_elems(config, *, text_tokens, **_):
    config = config.get("text_config") or config  # a multimodal model's language model (Gemma-3's)
    hidden = config.get("hidden_size") or config.get("d_model", 768)
    inner = config.get("intermediate_size") or config.get("d_ff") or 4 * hidden
    return text_tokens * max(hidden, inner)
