"""Models whose weights are single files: an all-in-one checkpoint (AUTOMATIC1111's and ComfyUI's ``checkpoints``),
a Flux transformer alone in its file (ComfyUI's ``diffusion_models``), or a model's components replaced by
files of their own (``--component vae=FILE``: ComfyUI's split layout, Forge's VAE / text encoder choice).

Either is a config folder plus one weight source per component (SingleFileModel): a diffusers folder
gives the configs, scheduler and tokenizers (memfit.models.single_file_configs finds one for a
checkpoint) and the weights of the components read from nowhere else; each other component is read
from its file, in the key layout found there (memfit.models.weight_layouts: a UNet or VAE in its
original LDM layout or diffusers', a CLIP encoder in transformers' or OpenCLIP's, a Flux transformer in
Black Forest Labs' or diffusers', a T5 encoder in transformers'). A checkpoint's family is found from
the tensor names and shapes in its header alone, by diffusers' own ``infer_diffusers_model_type``; a
family's file may lack some of its models (a Flux file is mostly the transformer alone), which then
come from the config folder or from ``--component`` files.

Streamed in place: a component's tensors are memory-mapped views of the file
(memfit.safetensors_header.MappedFile), converted to diffusers' names by diffusers' own converters.
A rename keeps the tensor, a 1x1 convolution read as a linear weight (``[:, :, 0, 0]``) or a row
slice of a fused tensor is a view, so the converted state dict holds views of the map, not copies,
and the component is built on the meta device and assigned those views. Where each live parameter
lives (key and view) is recorded on the module (``file_places``), so the disk tier streams it from
the file, the planner sizes it from the configs, and the weights check holds it to the file as a
folder's are. A tensor the converter had to compute (a transpose, a concatenation) is materialized
alone, recorded as such, and kept in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder, check_weight_entries, load_tensors_only, pickle_refused, size_mismatch
from memfit.models.locate import PICKLE_SUFFIXES, refuse_missing_model
from memfit.models.weight_layouts import (BFL_FLUX, CHROMA, LDM_UNET, LDM_VAE, MMDIT_SD3, OPEN_CLIP, ORIGINAL_WAN,
                                          ORIGINAL_WAN22_VAE, ORIGINAL_WAN_VAE, ORIGINAL_Z_IMAGE, QWEN_IMAGE, SD3_CLIP_L,
                                          TRANSFORMERS_CLIP, TRANSFORMERS_QWEN3, TRANSFORMERS_QWEN25_VL, TRANSFORMERS_T5,
                                          Layout, group_counts)
from memfit.plan.meta import is_model_class
from memfit.quant.formats import (FP8_FORMATS, INT8_FORMAT, INT8_SCALE_SUFFIX, STORAGE_DTYPE, StoredTensor,
                                  int8_row_scale)
from memfit.quant.gguf_file import MappedGguf
from memfit.safetensors_header import MappedFile, check_complete

__all__ = ["FAMILIES", "ComponentWeights", "Family", "FilePlaces", "SingleFileModel", "TensorPlace", "detect_family",
           "file_places", "file_shapes", "record_places"]

PLACES_ATTR = "_memfit_file_places"


@dataclass(frozen=True)
class Part:
    """One model of a family's file: the prefixes its tensors may share there (an empty one: the file holds it
    alone), their layout, and whether the family's files may lack it (``optional``: the config folder or a
    ``--component`` file gives it then; ``usual_file`` names the file users keep it in, for the message when
    neither does)."""

    prefixes: tuple[str, ...]
    layout: Layout
    optional: bool = False
    usual_file: str = ""
    # Words of the names users keep its files under (letters and digits only: "wan21" is wan_2.1_vae.safetensors'),
    # for a models folder where two files fit (Wan 2.1's VAE and Qwen-Image's have one architecture).
    hints: tuple[str, ...] = ()

    def named_for(self, path: Path) -> bool:
        """Whether the file ``path``'s name says it is this part's (one of ``hints`` in it)."""
        name = "".join(char for char in path.name.lower() if char.isalnum())
        return any(hint in name for hint in self.hints)

    def place(self, keys) -> str | None:
        """The prefix this part's tensors have in a file of tensor ``keys`` (where its layout's marker is); None
        when the file does not hold it."""
        return next((prefix for prefix in self.prefixes
                     if any(prefix + marker in keys for marker in self.layout.markers)), None)

    def describe(self, name: str) -> str:
        """e.g. "model.diffusion_model.* or the transformer alone" for component ``name``."""
        return " or ".join(f"{prefix}*" if prefix else f"the {name} alone" for prefix in self.prefixes)


@dataclass(frozen=True)
class Family:
    """A family of single-file checkpoints memfit opens: ``model_type`` is diffusers' name for it
    (infer_diffusers_model_type; memfit's own where diffusers has none), ``files`` the components whose files
    (scheduler, tokenizers) the config folder must hold beside the models' configs. A family whose files hold
    the denoiser alone (``denoiser_alone``: Wan's, Qwen-Image's, Chroma's, Z-Image's) takes every other model
    of the config folder from it (or from ``--component`` files); ``repository`` is where its configs are
    published when diffusers' single-file loading names none."""

    model_type: str
    label: str
    pipeline_class: str
    parts: dict[str, Part]
    files: tuple[str, ...]
    denoiser_alone: bool = False
    repository: str = ""
    # Where the configs of a pair of experts are published, for a file read with a transformer_2 beside it: a Wan
    # text-to-video transformer with a second expert is Wan 2.2 A14B's, whatever the width says.
    pair_repository: str = ""

    def describe(self) -> str:
        needed = ", ".join(part.describe(name) for name, part in self.parts.items() if not part.optional)
        # A part with no prefix is never in the family's files (a file of its own): not said here.
        optional = ", ".join(part.describe(name) for name, part in self.parts.items()
                             if part.optional and part.prefixes)
        return f"{self.label} ({needed}{'; optional: ' + optional if optional else ''})"


_UNET = Part(("model.diffusion_model.",), LDM_UNET)
_VAE = Part(("first_stage_model.",), LDM_VAE)
# ComfyUI's files: flux1-dev.safetensors holds the transformer alone, in Black Forest Labs' keys; an
# all-in-one Flux checkpoint has it under model.diffusion_model. beside the VAE and both text encoders,
# under the prefixes diffusers' single-file loading reads them from.
_FLUX_PARTS = {"transformer": Part(("model.diffusion_model.", ""), BFL_FLUX),
               "vae": Part(("vae.",), LDM_VAE, optional=True, usual_file="ae.safetensors"),
               "text_encoder": Part(("text_encoders.clip_l.transformer.",), TRANSFORMERS_CLIP, optional=True,
                                    usual_file="clip_l.safetensors"),
               "text_encoder_2": Part(("text_encoders.t5xxl.transformer.",), TRANSFORMERS_T5, optional=True,
                                      usual_file="t5xxl_fp16.safetensors")}
_FLUX_FILES = ("scheduler", "tokenizer", "tokenizer_2")
# Stability's all-in-one SD3 files (sd3_medium_incl_clips_t5xxlfp16.safetensors): the MMDiT under
# model.diffusion_model., the 16-channel VAE in LDM keys, CLIP-L, CLIP-G and T5-XXL in transformers' names under
# text_encoders.; sd3.5_large.safetensors holds the MMDiT alone, ComfyUI's diffusion_models/ files with no prefix.
_SD3_PARTS = {"transformer": Part(("model.diffusion_model.", ""), MMDIT_SD3),
              "vae": Part(("first_stage_model.",), LDM_VAE, optional=True),
              "text_encoder": Part(("text_encoders.clip_l.transformer.",), SD3_CLIP_L, optional=True,
                                   usual_file="clip_l.safetensors"),
              "text_encoder_2": Part(("text_encoders.clip_g.transformer.",), TRANSFORMERS_CLIP, optional=True,
                                     usual_file="clip_g.safetensors"),
              "text_encoder_3": Part(("text_encoders.t5xxl.transformer.",), TRANSFORMERS_T5, optional=True,
                                     usual_file="t5xxl_fp16.safetensors")}
_SD3_FILES = ("scheduler", "tokenizer", "tokenizer_2", "tokenizer_3")


def _denoiser(layout: Layout, **own_files: Part) -> dict[str, Part]:
    """A family whose files hold the transformer alone (ComfyUI's diffusion_models/), or under
    model.diffusion_model.: the rest of the pipeline comes from the config folder, or from files of their own
    (``own_files``: what memfit serve --models-dir pairs it with from vae/ and text_encoders/)."""
    return {"transformer": Part(("model.diffusion_model.", ""), layout), **own_files}


def _own_file(layout: Layout, usual_file: str, *hints: str) -> Part:
    """A model the family's files never hold, kept in a file of its own (``usual_file``, ComfyUI's name for it)."""
    return Part((), layout, optional=True, usual_file=usual_file, hints=hints)


# The files ComfyUI keeps beside each denoiser alone, by the pipelines' component names.
_WAN21_FILES = {"vae": _own_file(ORIGINAL_WAN_VAE, "wan_2.1_vae.safetensors", "wan21"),
                "text_encoder": _own_file(TRANSFORMERS_T5, "umt5_xxl_fp16.safetensors", "umt5")}
_WAN22_5B_FILES = {**_WAN21_FILES, "vae": _own_file(ORIGINAL_WAN22_VAE, "wan2.2_vae.safetensors", "wan22")}
_QWEN_IMAGE_FILES = {"vae": _own_file(ORIGINAL_WAN_VAE, "qwen_image_vae.safetensors", "qwenimage"),
                     "text_encoder": _own_file(TRANSFORMERS_QWEN25_VL, "qwen_2.5_vl_7b.safetensors", "qwen25vl")}
_CHROMA_FILES = {"vae": _own_file(LDM_VAE, "ae.safetensors"),
                 "text_encoder": _own_file(TRANSFORMERS_T5, "t5xxl_fp16.safetensors", "t5xxl")}
_Z_IMAGE_FILES = {"vae": _own_file(LDM_VAE, "ae.safetensors"),
                  "text_encoder": _own_file(TRANSFORMERS_QWEN3, "qwen_3_4b.safetensors", "qwen3")}

FAMILIES = {
    "v1": Family("v1", "Stable Diffusion 1.x", "StableDiffusionPipeline",
                 {"unet": _UNET, "vae": _VAE, "text_encoder": Part(("cond_stage_model.transformer.",), TRANSFORMERS_CLIP)},
                 ("scheduler", "tokenizer")),
    "xl_base": Family("xl_base", "Stable Diffusion XL", "StableDiffusionXLPipeline",
                      {"unet": _UNET, "vae": _VAE,
                       "text_encoder": Part(("conditioner.embedders.0.transformer.",), TRANSFORMERS_CLIP),
                       "text_encoder_2": Part(("conditioner.embedders.1.model.",), OPEN_CLIP)},
                      ("scheduler", "tokenizer", "tokenizer_2")),
    # SD 2's OpenCLIP encoder: its file holds a layer more than the model runs (the penultimate layer's
    # output is used) and a projection it does not use; both are left out, as diffusers leaves them.
    "v2": Family("v2", "Stable Diffusion 2.x", "StableDiffusionPipeline",
                 {"unet": _UNET, "vae": _VAE, "text_encoder": Part(("cond_stage_model.model.",), OPEN_CLIP)},
                 ("scheduler", "tokenizer")),
    "xl_refiner": Family("xl_refiner", "Stable Diffusion XL refiner", "StableDiffusionXLImg2ImgPipeline",
                         {"unet": _UNET, "vae": _VAE, "text_encoder_2": Part(("conditioner.embedders.0.model.",), OPEN_CLIP)},
                         ("scheduler", "tokenizer_2")),
    "flux-dev": Family("flux-dev", "Flux.1 [dev]", "FluxPipeline", _FLUX_PARTS, _FLUX_FILES),
    "flux-schnell": Family("flux-schnell", "Flux.1 [schnell]", "FluxPipeline", _FLUX_PARTS, _FLUX_FILES),
    "sd3": Family("sd3", "Stable Diffusion 3", "StableDiffusion3Pipeline", _SD3_PARTS, _SD3_FILES),
    "sd35_large": Family("sd35_large", "Stable Diffusion 3.5 Large", "StableDiffusion3Pipeline", _SD3_PARTS, _SD3_FILES),
    "sd35_medium": Family("sd35_medium", "Stable Diffusion 3.5 Medium", "StableDiffusion3Pipeline", _SD3_PARTS,
                          _SD3_FILES),
    "wan-t2v-1.3B": Family("wan-t2v-1.3B", "Wan text-to-video 1.3B", "WanPipeline",
                           _denoiser(ORIGINAL_WAN, **_WAN21_FILES), ("scheduler", "tokenizer"), denoiser_alone=True,
                           pair_repository="Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
    "wan-t2v-14B": Family("wan-t2v-14B", "Wan text-to-video 14B", "WanPipeline",
                          _denoiser(ORIGINAL_WAN, **_WAN21_FILES), ("scheduler", "tokenizer"), denoiser_alone=True,
                          pair_repository="Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
    # diffusers' single-file loading has no name for Wan 2.2's 5B (it calls it "wan-i2v-14B").
    "wan-ti2v-5B": Family("wan-ti2v-5B", "Wan 2.2 5B", "WanPipeline", _denoiser(ORIGINAL_WAN, **_WAN22_5B_FILES),
                          ("scheduler", "tokenizer"), denoiser_alone=True,
                          repository="Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
    # Wan 2.2 I2V A14B's experts (ComfyUI's wan2.2_i2v_high_noise_14B_*.safetensors): the condition latents and mask
    # beside the noise, no image embedder. diffusers' single-file loading calls them "wan-i2v-14B", as Wan 2.1 I2V.
    "wan2.2-i2v-A14B": Family("wan2.2-i2v-A14B", "Wan 2.2 image-to-video A14B", "WanImageToVideoPipeline",
                              _denoiser(ORIGINAL_WAN, **_WAN21_FILES), ("scheduler", "tokenizer"), denoiser_alone=True,
                              repository="Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
    "qwen-image": Family("qwen-image", "Qwen-Image", "QwenImagePipeline", _denoiser(QWEN_IMAGE, **_QWEN_IMAGE_FILES),
                         ("scheduler", "tokenizer"), denoiser_alone=True, repository="Qwen/Qwen-Image"),
    "chroma": Family("chroma", "Chroma", "ChromaPipeline", _denoiser(CHROMA, **_CHROMA_FILES),
                     ("scheduler", "tokenizer"), denoiser_alone=True),
    "z-image-turbo": Family("z-image-turbo", "Z-Image", "ZImagePipeline", _denoiser(ORIGINAL_Z_IMAGE, **_Z_IMAGE_FILES),
                            ("scheduler", "tokenizer"), denoiser_alone=True),
}


def _mmdit_type(shapes, prefix: str) -> str:
    """SD3 Medium, SD3.5 Large (q/k norms) or SD3.5 Medium (q/k norms and a second attention), by structure."""
    if f"{prefix}joint_blocks.0.x_block.attn2.qkv.weight" in shapes:
        return "sd35_medium"
    return "sd35_large" if f"{prefix}joint_blocks.0.x_block.attn.ln_q.weight" in shapes else "sd3"


def _wan_type(shapes, prefix: str) -> str | None:
    """A text-to-video Wan transformer's size (Wan 2.2's 5B is 3072 wide), or Wan 2.2 I2V A14B's expert (more input
    channels than output ones: the condition latents and mask); None for Wan 2.1's image-to-video one (its image
    embedder), which memfit does not open as a single file."""
    if any(key.startswith(f"{prefix}img_emb.") for key in shapes):
        return None
    patch = shapes.get(f"{prefix}patch_embedding.weight", (None, [0, 0, 1, 1, 1]))[1]
    head = shapes.get(f"{prefix}head.head.weight")
    patch_size = patch[2] * patch[3] * patch[4] if len(patch) == 5 else 1
    if head is not None and patch[1] * patch_size != head[1][0]:
        return "wan2.2-i2v-A14B"
    width = patch[0]
    return "wan-t2v-1.3B" if width <= 1536 else "wan-ti2v-5B" if width == 3072 else "wan-t2v-14B"


# The denoisers memfit knows by their layout's marker, where diffusers' inference cannot tell: it tells SD3's
# and Wan's sizes apart by the released models' widths and depths (SD3's 9216-wide modulation and 36864-long
# position table, SD3.5 Large's 38th block, Wan's 1536 or 5120 channels), so a file of another size (a pruned
# or distilled model, a tiny test model) gets no type, or a wrong one; and Qwen-Image's own files keep
# diffusers' names, from which diffusers infers nothing. memfit tells the variants apart by structure instead.
_KNOWN_BY_MARKER = ((MMDIT_SD3, _mmdit_type), (ORIGINAL_WAN, _wan_type), (QWEN_IMAGE, lambda shapes, prefix: "qwen-image"))


def _type_by_marker(shapes) -> str | None:
    for layout, model_type in _KNOWN_BY_MARKER:
        for prefix in ("model.diffusion_model.", ""):
            if any(prefix + marker in shapes for marker in layout.markers):
                return model_type(shapes, prefix)
    return None


def detect_family(path: Path, shapes: dict[str, tuple[torch.dtype, list[int]]]) -> Family:
    """The family of the checkpoint whose tensors are ``shapes`` (name -> (dtype, shape)), from names and
    shapes alone; one sentence naming what was found when memfit does not open it."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    # diffusers reads names and shapes; meta tensors give it both without a byte of data.
    probe = {key: torch.empty(shape, dtype=dtype, device="meta") for key, (dtype, shape) in shapes.items()}
    try:
        model_type = infer_diffusers_model_type(probe)
    except Exception:  # noqa: BLE001 - a branch that reads values, or a shape it did not expect: unknown to us
        model_type = None
    if model_type not in FAMILIES or model_type == "v1":  # diffusers' "v1" is also its answer for what it does not know
        model_type = _type_by_marker(shapes) or model_type
    family = FAMILIES.get(model_type)
    supported = "; ".join(f.describe() for f in FAMILIES.values())
    if family is not None:
        absent = {name: part for name, part in family.parts.items() if part.place(shapes) is None}
        missing = [part.describe(name) for name, part in absent.items() if not part.optional]
        if not missing:
            return family
        # diffusers calls whatever it does not recognise "v1": only the keys tell.
        if len(absent) < len(family.parts):
            raise MemfitError(
                f"{path} holds part of a {family.label} checkpoint but no {', '.join(missing)} tensors; memfit opens "
                f"all-in-one checkpoints, which hold every model of the pipeline (supported: {supported}).")
    elif model_type is not None:
        raise MemfitError(
            f"{path} is a checkpoint diffusers calls {model_type!r}, which memfit cannot open as a single file yet "
            f"(supported: {supported}); convert it to a diffusers folder with diffusers' from_single_file and "
            "save_pretrained, and pass that folder as --model.")
    raise MemfitError(f"{path} holds {len(shapes)} tensors in a layout memfit does not recognise ({group_counts(shapes)}); "
                      f"memfit opens all-in-one checkpoints of: {supported}.")


@dataclass(frozen=True)
class TensorPlace:
    """Where a live tensor lives in its file: the stored tensor ``key``, and the view of it (shape, stride,
    offset in elements) that the conversion made of it."""

    key: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class FilePlaces:
    """Where each live tensor of one component loaded from a single file lives in that file.

    ``places``: live name -> TensorPlace; ``materialized``: the names conversion had to compute, in no
    file. ``file`` is None for a pickle checkpoint, whose tensors memfit cannot map (``why`` says so).
    Shared, never copied, by copies of the module (the file behind it never changes while memfit runs).
    """

    def __init__(self, path: Path, file: MappedFile | None, places: dict[str, TensorPlace],
                 materialized: frozenset[str], why: str = ""):
        self.path = path
        self.file = file
        self.places = places
        self.materialized = materialized
        self.why = why

    def view(self, live_name: str) -> tuple[MappedFile, str, torch.Tensor] | None:
        """(file, stored key, the view of it that is ``live_name``), or None when the file does not hold it."""
        place = self.places.get(live_name)
        if place is None or self.file is None:
            return None
        stored = _stored_bytes(self.file.tensor(place.key))
        return self.file, place.key, stored.as_strided(place.shape, place.stride, place.offset)

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


def file_shapes(path: Path) -> dict[str, tuple[torch.dtype, list[int]]]:
    """The tensors of the .safetensors or .gguf file ``path`` by name: (dtype, logical shape), from its header."""
    return _Checkpoint(path, allow_pickle=False).shapes


def _stored_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A file's tensor as memfit holds it: an fp8 one as its bytes (memfit.quant), the rest as they are."""
    return tensor.view(STORAGE_DTYPE) if tensor.dtype in FP8_FORMATS else tensor


def file_places(module: torch.nn.Module) -> FilePlaces | None:
    """The places ``module``'s weights were loaded from, when it was loaded from a single file."""
    return vars(module).get(PLACES_ATTR)


def record_places(module: torch.nn.Module, places: FilePlaces) -> None:
    object.__setattr__(module, PLACES_ATTR, places)


class _Checkpoint:
    """The tensors of one checkpoint file: names, dtypes and shapes from its header, and views of its
    memory map (safetensors), or the tensors torch's weights_only loader read (pickle)."""

    def __init__(self, path: Path, allow_pickle: bool):
        self.path = path
        self.file: MappedFile | MappedGguf | None = None
        self._pickled: dict[str, torch.Tensor] = {}
        # The tensors stored smaller than they run (GGUF blocks, fp8), and the tensors that only describe them
        # (an fp8 weight's scale): no model has those, so they are not converted.
        self.stored: dict[str, StoredTensor] = {}
        self.side_keys: frozenset[str] = frozenset()
        if path.suffix == ".safetensors":
            self.file = MappedFile(path, check_complete(path))
            self.shapes = {key: (self.file.dtype(key), list(entry["shape"])) for key, entry in self.file.entries.items()}
            self._read_fp8()
            return
        if path.suffix == ".gguf":
            self.file = MappedGguf(path)
            self.stored = {key: StoredTensor(fmt, self.file.logical_shape(key)) for key, fmt in self.file.formats.items()}
            self.shapes = {key: (self.file.dtype(key), list(self.file.logical_shape(key))) for key in self.file.entries}
            return
        if path.suffix not in PICKLE_SUFFIXES:
            raise MemfitError(f"{path} is not a checkpoint memfit opens: give a .safetensors or .gguf file (or a .ckpt "
                              "with --allow-pickle), or a diffusers model folder.")
        if not allow_pickle:
            raise MemfitError(pickle_refused(path, path.with_suffix(".safetensors")))
        state = load_tensors_only(path)
        state = state.get("state_dict", state) if isinstance(state, dict) else {}
        self._pickled = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
        self.shapes = {key: (value.dtype, list(value.shape)) for key, value in self._pickled.items()}

    def _read_fp8(self) -> None:
        """The fp8 weights of a safetensors file, each with its scale where the file has one: Comfy's "scaled" fp8
        files keep a float32 ``scale_weight`` (or ``weight_scale``) beside each weight, a ``scale_input`` for fp8
        matmuls memfit does not run, and a ``scaled_fp8`` marker."""
        side = {key for key in self.shapes if key == "scaled_fp8" or key.endswith(".scale_input")}
        for key, (dtype, shape) in self.shapes.items():
            if dtype == torch.int8 and (scale := int8_row_scale(self.file, key, self.shapes)) is not None:
                side.add(key + INT8_SCALE_SUFFIX)  # memfit's int8 (--quantize NAME=int8): one scale per row
                self.stored[key] = StoredTensor(INT8_FORMAT, tuple(shape), scale)
                continue
            if dtype not in FP8_FORMATS:
                continue
            base = key.removesuffix(".weight")
            scale_key = next((k for k in (f"{base}.scale_weight", f"{base}.weight_scale") if k in self.shapes), None)
            scale = None
            if scale_key is not None and key.endswith(".weight"):
                side.add(scale_key)
                scale = self.file.tensor(scale_key).to(torch.float32)
                if scale.numel() != 1:
                    raise MemfitError(f"{self.path} scales {key} by {scale_key} of shape {list(scale.shape)}: memfit "
                                      "reads fp8 files with one scale per tensor; use such a file, or one in bf16.")
                scale = scale.reshape(())
            self.stored[key] = StoredTensor(FP8_FORMATS[dtype], tuple(shape), scale)
        self.side_keys = frozenset(side)
        for key in side:
            self.stored.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        return [key for key in self.shapes if key.startswith(prefix)]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor under ``prefix``: views of the mapped file, no data read."""
        if self.file is None:
            return {key: self._pickled[key] for key in self.keys(prefix)}
        return {key: _stored_bytes(self.file.tensor(key)) for key in self.keys(prefix)}

    def places(self, source: dict[str, torch.Tensor], converted: dict[str, torch.Tensor]) -> FilePlaces:
        """Where each tensor of ``converted`` (made from the views ``source``) lives in the file."""
        if self.file is None:
            return FilePlaces(self.path, None, {}, frozenset(converted),
                              why=f"{self.path} is a pickle checkpoint, which memfit cannot memory-map")
        by_storage = {tensor.untyped_storage().data_ptr(): key for key, tensor in source.items() if tensor.numel()}
        places, materialized = {}, set()
        for name, tensor in converted.items():
            key = by_storage.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
            if key is None:
                materialized.add(name)
            else:
                places[name] = TensorPlace(key, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        return FilePlaces(self.path, self.file, places, frozenset(materialized))


def _keep_in_fp32(cls, library: str, dtype: torch.dtype) -> list[str]:
    """The modules ``cls`` keeps in fp32 when loaded at ``dtype``, as diffusers and transformers do."""
    if dtype == torch.float32:
        return []
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    if library == "transformers":
        keep += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def _empty_model(library: str, class_name: str, config: dict, config_dir: Path) -> torch.nn.Module:
    """The component built from its config with its parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(library), class_name)
    with init_empty_weights():
        if library == "diffusers":
            return cls.from_config(config)
        return cls(cls.config_class.from_pretrained(config_dir))


@dataclass(frozen=True)
class ComponentWeights:
    """Where one component's weights are: a checkpoint file, the prefix the component's tensors share there,
    and the layout they are stored in."""

    checkpoint: _Checkpoint
    prefix: str
    layout: Layout

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    def keys(self) -> list[str]:
        return self.checkpoint.keys(self.prefix)

    def converted(self, module: torch.nn.Module, config: dict, *, probe: bool = False):
        """(stored key -> tensor, the tensors under diffusers' names, {name: StoredTensor} of those stored smaller
        than they run) for ``module`` (its empty model): views of the file, or with ``probe``
        shapes alone (meta tensors, no data read). A stored tensor is its bytes (memfit.quant)."""
        stored, side = self.checkpoint.stored, self.checkpoint.side_keys
        if probe:
            source = {key: torch.empty(stored[key].format.stored_shape(stored[key].shape) if key in stored
                                       else self.checkpoint.shapes[key][1],
                                       dtype=STORAGE_DTYPE if key in stored else self.checkpoint.shapes[key][0],
                                       device="meta") for key in self.keys() if key not in side}
        else:
            source = {key: tensor for key, tensor in self.checkpoint.tensors(self.prefix).items() if key not in side}
        named = {key[len(self.prefix):]: tensor for key, tensor in source.items()}
        named_stored = {key[len(self.prefix):]: stored[key] for key in source if key in stored}
        if not named_stored:
            return source, self.layout.convert(named, config, module), {}
        from memfit.quant.rows import convert_stored

        converted, formats = convert_stored(lambda tensors: self.layout.convert(tensors, config, module), named,
                                            named_stored, str(self.path))
        return source, converted, formats


@dataclass
class SingleFileModel(ModelFolder):
    """A model made of a config folder and one weight source per component: a diffusers folder of its family
    (``config_dir``; ``config_source`` says how it was found) for configs, scheduler, tokenizers and the
    weights of the components not in ``weights``, and for each component in ``weights`` the file it is read
    from. An all-in-one checkpoint (``path``, the file) has every model in ``weights``; a diffusers folder with
    components replaced by files of their own (``--component vae=FILE``; ``path`` is the folder) has those.
    It runs wherever a ModelFolder does."""

    family: Family | None = None
    config_dir: Path | None = None
    config_source: str = ""
    # Every component the config folder's model_index.json names: those not loaded are passed as None.
    config_components: tuple[str, ...] = ()
    config_flag: str = "--config"  # how the user names the config folder (the refiner's: --refiner-config)
    weights: dict[str, ComponentWeights] = field(default_factory=dict, repr=False, compare=False)
    # The components quantized on the fly (--quantize), by type: their weights are in memfit's cache.
    quantized: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open_file(cls, path: str | Path, *, config: str | Path | None = None, allow_pickle: bool = False,
                  config_flag: str = "--config", paired: bool = False) -> "SingleFileModel":
        """Open the checkpoint ``path``: its family from the header, its configs from ``config`` (a diffusers
        folder of that family, the user's ``config_flag``) or where memfit.models.single_file_configs finds them
        (``paired``: a second expert is read beside it, so those of the family's pair_repository).
        The family's models the file lacks (optional parts) are read from that folder."""
        from memfit.models.single_file_configs import find_configs

        path = Path(path).expanduser()
        refuse_missing_model(path)
        checkpoint = _Checkpoint(path, allow_pickle)
        family = detect_family(path, checkpoint.shapes)
        config_dir, source = find_configs(path, family, config, config_flag, paired=paired)
        configs = ModelFolder.open(config_dir)
        if configs.class_name != family.pipeline_class:
            raise MemfitError(
                f"{config_dir} is a {configs.class_name} folder, but {path} is a {family.label} checkpoint "
                f"({family.pipeline_class}); give {config_flag} a diffusers folder of the same family.")
        # The models the file does not hold (a safety checker, an image encoder) are left out, as
        # diffusers' single-file loading leaves them.
        listed = tuple(configs.components)
        missing = [name for name in family.parts if name not in listed]
        if missing:
            raise MemfitError(f"{config_dir / 'model_index.json'} lists no {', '.join(missing)}, which a {family.label} "
                              f"checkpoint holds; give {config_flag} the diffusers folder of a complete pipeline.")
        configs.components = {name: value for name, value in configs.components.items()
                              if name in family.parts or family.denoiser_alone or not is_model_class(*value)}
        configs.check_layout()
        configs.require_configs(family.parts)
        places = {name: part.place(checkpoint.shapes) for name, part in family.parts.items()}
        weights = {name: ComponentWeights(checkpoint, places[name], part.layout) for name, part in family.parts.items()
                   if places[name] is not None}
        return cls(path, configs.class_name, configs.components, configs.configs, configs.defaults,
                   allow_pickle=allow_pickle, family=family, config_dir=config_dir, config_source=source,
                   config_components=listed, config_flag=config_flag, weights=weights)

    @classmethod
    def with_components(cls, model: ModelFolder, components: dict[str, str | Path], *,
                        allow_pickle: bool = False, quantized: dict[str, str] | None = None) -> "SingleFileModel":
        """``model`` (a folder or a checkpoint) with each component named in ``components`` read from the file
        given for it, in a layout memfit reads for its class (memfit.models.weight_layouts); refused, naming
        both, when the file holds another architecture or size than the model's config. ``quantized``: the
        components whose file memfit wrote quantizing them (memfit.models.quantize), by type: in their own names."""
        if isinstance(model, SingleFileModel):
            combined = dataclasses.replace(model, weights=dict(model.weights), _fingerprints={},
                                           quantized={**model.quantized, **(quantized or {})})
        else:
            combined = cls(model.path, model.class_name, model.components, model.configs, model.defaults,
                           allow_pickle=model.allow_pickle, config_dir=model.path, config_components=tuple(model.components),
                           quantized=dict(quantized or {}))
        combined.allow_pickle = combined.allow_pickle or allow_pickle
        for name, file in components.items():
            if name in (quantized or {}):
                from memfit.models.weight_layouts import AS_SAVED

                weights = ComponentWeights(_Checkpoint(Path(file), allow_pickle=False), "", AS_SAVED)
                combined._assign(name, weights, probe=True)
                combined.weights[name] = weights
            else:
                combined.weights[name] = combined._component_file(name, Path(file).expanduser())
        return combined

    def _component_file(self, name: str, path: Path) -> ComponentWeights:
        """Where component ``name``'s weights are in ``path``: the first layout and place in it that fits the
        component's config."""
        from memfit.models.weight_layouts import COMPONENT_LAYOUTS, component_layouts, find_layouts, group_counts

        if name not in self.model_components:
            what = f"'s {name!r} is a {self.components[name][1]}, which has no weights" if name in self.components \
                else f" has no component {name!r}"
            raise MemfitError(f"--component {name}={path}: {self.path}{what}; the components a file can replace "
                              f"are: {self.listed_model_components()}.")
        library, class_name = self.model_components[name]
        if not path.is_file():
            raise MemfitError(f"--component {name}={path}: {path} does not exist; give the file of a {class_name} "
                              f"for {name} (.safetensors).")
        if class_name not in COMPONENT_LAYOUTS:
            raise MemfitError(f"--component {name}={path}: memfit cannot read a {class_name} from a file of its own "
                              f"yet (it reads {', '.join(COMPONENT_LAYOUTS)}); give a diffusers model folder instead.")
        checkpoint = _Checkpoint(path, self.allow_pickle)
        layouts = component_layouts(self.class_name, name, class_name)
        found = find_layouts(layouts, checkpoint.shapes)
        if not found:
            layouts = ", ".join(layout.describe() for layout in layouts)
            raise MemfitError(
                f"--component {name}={path}: the file holds no {class_name} in a layout memfit reads ({layouts}); it "
                f"holds {len(checkpoint.shapes)} tensors: {group_counts(checkpoint.shapes)}. Give a {name} file of "
                "this model's family.")
        refusal = None
        for layout, prefix in found:
            weights = ComponentWeights(checkpoint, prefix, layout)
            try:
                self._assign(name, weights, probe=True)
            except MemfitError as exc:
                refusal = refusal or exc
                continue
            return weights
        raise MemfitError(f"--component {name}={path} does not fit {self.path.name}: {refusal}") from None

    def check_fits(self) -> None:
        """Build every component the files give on the meta device (no data read): MemfitError names the first
        whose weights do not fit its config."""
        for name, weights in self.weights.items():
            self._assign(name, weights, probe=True)

    @property
    def config_folder(self) -> Path:
        return self.config_dir

    @cached_property
    def adapter(self):
        """As a folder's, with each component read from a file that stores weights smaller than they run
        (memfit.quant) sized from that file: the stored bytes, not the config's."""
        adapter = super().adapter
        for name, weights in self.weights.items():
            if any(key in weights.checkpoint.stored for key in weights.keys()):
                adapter.measured_sizes[name] = functools.partial(self._stored_size, name)
        return adapter

    def _stored_size(self, name: str, dtype: str):
        from memfit.plan.meta import measure_module

        probes = vars(self).setdefault("_probes", {})  # built once: a plan asks for each dtype and stage
        if name not in probes:
            probes[name] = self._assign(name, self.weights[name], probe=True)  # on the meta device: no data read
        return measure_module(name, probes[name], dtype)

    def _index_components(self):
        return self.config_components

    def describe_source(self) -> str:
        notes = []
        if self.family is not None:
            notes.append(f"model: {self.path.name}, a {self.family.label} single-file checkpoint ({self.class_name}); "
                         f"configs and tokenizers from {self.config_source}")
            absent = [name for name in self._family_models() if name not in self.weights]
            if absent:
                notes.append(f"{', '.join(absent)} not in the file: read from {self.config_dir}")
        replaced = [f"{name} from {weights.path} ({weights.layout.name} layout)" for name, weights in self.weights.items()
                    if weights.path != self.path and name not in self.quantized]
        if self.quantized:
            notes.append("quantized on the fly (kept in memfit's cache): " + ", ".join(
                f"{name} to {kind}" for name, kind in self.quantized.items()))
        if replaced:
            notes.append("components from files of their own: " + ", ".join(replaced))
        return "; ".join(notes)

    def component_fingerprint(self, name: str) -> str:
        """A model read from a file by the tensors it reads there (and its config); the rest as a folder's."""
        weights = self.weights.get(name)
        if weights is None:
            return super().component_fingerprint(name)
        if name not in self._fingerprints:
            from memfit.cache.fingerprint import combine_fingerprints, fingerprint_tensors

            if weights.checkpoint.file is None:  # pickle: its tensors' bytes, read once
                tensors = weights.checkpoint.tensors(weights.prefix)
                self._fingerprints[name] = combine_fingerprints(
                    f"{key}:{tensor.dtype}:{list(tensor.shape)}:{_hash_tensor(tensor)}" for key, tensor in tensors.items())
            elif isinstance(weights.checkpoint.file, MappedGguf):  # a GGUF file holds one model: all its bytes
                from memfit.cache.fingerprint import fingerprint_path

                config = (self.config_dir / name / "config.json").read_text(encoding="utf-8")
                self._fingerprints[name] = combine_fingerprints([f"gguf:{fingerprint_path(weights.path)}", config])
            else:
                config = (self.config_dir / name / "config.json").read_bytes()
                self._fingerprints[name] = fingerprint_tensors(weights.path, weights.keys(), config)
        return self._fingerprints[name]

    def check_weights(self, names) -> None:
        """Files were checked when opened (a truncated file, a pickle without allow_pickle); the rest as a folder's.
        A model the checkpoint lacks (a Flux transformer alone in its file) is read from the config folder, which
        may hold only configs: refused then, naming the --component flag that gives it."""
        from_folder = [name for name in names if name not in self.weights]
        lacking = [name for name in self._family_models() if name not in self.weights and not self.weight_files(name)]
        if any(name in lacking for name in from_folder):
            models = ", ".join(f"{name} ({self.components[name][1]})" for name in lacking)
            usual = {name: part.usual_file for name, part in self.family.parts.items()}
            flags = ", ".join(f"--component {name}=FILE (e.g. {usual.get(name) or 'a .safetensors'})" for name in lacking)
            raise MemfitError(f"{self.path} holds no {models}, and {self.config_dir} holds no weights for them: give "
                              f"{flags}, or {self.config_flag} a diffusers folder that holds their weights.")
        super().check_weights(from_folder)

    def _family_models(self) -> list[str]:
        """The models a checkpoint of this family holds or may hold: for a denoiser alone, every model of the
        config folder (the file gives the denoiser, the folder or --component files the rest)."""
        if self.family is None:
            return []
        return list(self.model_components) if self.family.denoiser_alone else list(self.family.parts)

    def weight_files(self, name: str) -> list[Path]:
        return [self.weights[name].path] if name in self.weights else super().weight_files(name)

    def file_dtype(self, name: str) -> torch.dtype | None:
        weights = self.weights.get(name)
        if weights is None:
            return super().file_dtype(name)
        if weights.checkpoint.file is None:
            return None
        found = {weights.checkpoint.shapes[key][0] for key in weights.keys() if key not in weights.checkpoint.stored}
        found = {dtype for dtype in found if dtype.is_floating_point}
        return found.pop() if len(found) == 1 else None

    def _load_apart(self, names, dtype: torch.dtype, in_file_dtype) -> dict[str, torch.nn.Module]:
        """Each model read from a file converted from views of it; the config folder gives the rest."""
        return {name: self._assign(name, self.weights[name], None if name in in_file_dtype else dtype)
                for name in names if name in self.weights}

    def _assign(self, name: str, weights: ComponentWeights, dtype: torch.dtype | None = None, *,
                probe: bool = False) -> torch.nn.Module:
        """Component ``name`` built from its config on the meta device and assigned the converted views of its
        file: in ``dtype`` (converted copies), or as stored when ``dtype`` is None. With ``probe``, only checked
        (shapes, missing and unexpected tensors) without reading a byte of data."""
        library, class_name = self.components[name]
        config = self.configs[name]
        config_file = self.config_dir / name / "config.json"
        module = _empty_model(library, class_name, config, self.config_dir / name)
        source, converted, stored = weights.converted(module, config, probe=probe)
        if stored:
            converted = self._use_stored(name, module, weights, converted, stored, source, config_file)
        entries = {key: (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), weights.path)
                   for key, tensor in converted.items()}
        keep = _keep_in_fp32(type(module), library, dtype) if dtype is not None else []
        state = {}
        for key, tensor in converted.items():
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(torch.float32 if any(word in keep for word in key.split(".")) else dtype)
            state[key] = tensor
        try:
            module.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as exc:
            mismatch = size_mismatch(exc)
            if mismatch is None:
                raise MemfitError(f"Could not load {name} ({class_name}) from {weights.path}: {exc}") from None
            raise MemfitError(self._mismatch(name, weights, converted, source, mismatch, config_file)) from None
        if library == "transformers":
            module.tie_weights()  # as from_pretrained: a tied tensor (T5's embed_tokens) given once is shared again
        # Missing, unexpected: as a folder's; a stray dtype is cast like every other tensor, as diffusers does.
        check_weight_entries(module, name, self.config_dir / name, entries, weights.path, one_dtype=False)
        if probe:
            return module
        module.eval()
        record_places(module, weights.checkpoint.places(source, converted))
        return module

    def _use_stored(self, name: str, module: torch.nn.Module, weights: ComponentWeights, converted: dict,
                    stored: dict, source: dict, config_file: Path) -> dict:
        """``module`` (empty) with a QuantizedLinear or QuantizedConv2d wherever a linear or 2-D convolution weight
        is stored smaller than it runs; the stored weights of other modules (an embedding, a 3-D convolution)
        dequantized to float32 once, in memory (memfit.quant.layers). Refused, naming both shapes, where a
        stored weight is not the model's shape."""
        from memfit.quant.layers import use_stored_layers

        others, mismatched = use_stored_layers(module, stored)
        if mismatched:
            key, found, needed = mismatched[0]
            logical = {**converted, **{key: torch.empty(tensor.shape, device="meta") for key, tensor in stored.items()}}
            raise MemfitError(self._mismatch(name, weights, logical, source, (key, list(found), list(needed)),
                                             config_file))
        converted = dict(converted)
        for key in others:
            tensor = converted[key]
            converted[key] = torch.empty(stored[key].shape, device="meta") if tensor.is_meta else \
                stored[key].dequantize(tensor, torch.float32)
        return converted

    def _mismatch(self, name: str, weights: ComponentWeights, converted: dict, source: dict, mismatch,
                  config_file: Path) -> str:
        """The sentence for a tensor of ``weights`` whose shape is not the one ``config_file`` needs."""
        key, stored, needed = mismatch
        by_tensor = {id(tensor): stored_key for stored_key, tensor in source.items()}
        stored_key = by_tensor.get(id(converted.get(key)), key)
        tensor = f"Tensor {stored_key!r} in {weights.path} ({name}'s {key!r}) has shape {stored} where " \
                 f"{config_file} needs {needed}"
        if self.family is not None and weights.path == self.path:
            return (f"{tensor}; the configs are for another model: give {self.config_flag} a diffusers folder of this "
                    "checkpoint's family and size.")
        size = _size_named(self.components[name][1], converted, self.configs[name])
        told = f"{size} ({tensor[0].lower() + tensor[1:]})" if size else tensor
        return f"{told}; give a {name} of this model's family."


# What tells two sizes of a component apart, in words: (how it reads, the live tensor and its dimension that
# are it, its value in the config).
_SIZE_NAMES = {
    "AutoencoderKL": ("{} latent channels", "decoder.conv_in.weight", 1, lambda config: config.get("latent_channels")),
    "CLIPTextModel": ("width {}", "token_embedding.weight", 1, lambda config: config.get("hidden_size")),
    "CLIPTextModelWithProjection": ("width {}", "token_embedding.weight", 1, lambda config: config.get("hidden_size")),
    "FluxTransformer2DModel": ("width {}", "x_embedder.weight", 0,
                               lambda config: config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)),
    "T5EncoderModel": ("width {}", "shared.weight", 1, lambda config: config.get("d_model")),
    "UMT5EncoderModel": ("width {}", "shared.weight", 1, lambda config: config.get("d_model")),
    # transformers 5 nests Qwen2.5-VL's text width in text_config; older configs (Qwen-Image's own) keep it on top.
    "Qwen2_5_VLForConditionalGeneration": ("width {}", "embed_tokens.weight", 1, lambda config: config.get(
        "hidden_size") or config.get("text_config", {}).get("hidden_size")),
    "Qwen3Model": ("width {}", "embed_tokens.weight", 1, lambda config: config.get("hidden_size")),
    "Qwen3ForCausalLM": ("width {}", "embed_tokens.weight", 1, lambda config: config.get("hidden_size")),
}


def _size_named(class_name: str, converted: dict, config: dict) -> str:
    """e.g. "the file's AutoencoderKL has 16 latent channels where the model's has 4 latent channels", when the
    file's size differs there."""
    words, live, dimension, configured = _SIZE_NAMES.get(class_name, (None, None, None, None))
    found = next((tensor for key, tensor in converted.items() if key.endswith(live)), None) if words else None
    if found is None or found.ndim <= dimension or found.shape[dimension] == configured(config):
        return ""
    return (f"the file's {class_name} has {words.format(found.shape[dimension])} where the model's has "
            f"{words.format(configured(config))}")


def _hash_tensor(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
