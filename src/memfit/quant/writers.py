"""Quantizing a component's weights into a file memfit reads back like a user's quantized file.

Which layers, fp8: those diffusers' layerwise casting stores smaller (its supported layers, outside its skip
patterns: norms, position and patch embeddings, proj_in/proj_out, and a model's own
``_skip_layerwise_casting_patterns`` and ``_keep_in_fp32_modules``), so an fp8 component holds exactly
the values ``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn)`` holds: every weight and bias
of those layers rounded to fp8.

Which layers, int8 and the GGUF types (weight-only: a layer's weight is stored quantized, its bias and every
other tensor keep their dtype): those the GGUF files users download have quantized, and, for the 8-bit types
(``CONVOLUTION_TYPES``), the 2-D convolutions too. That is every ``nn.Linear`` (and ``nn.Conv2d``) whose weight
has more than ``SMALL_WEIGHT_ELEMENTS`` values and whose rows are whole blocks of the type (a convolution's row:
its flattened kernel, in/groups * kh * kw values), except

* the model's first and last layers, kept in their dtype: its input, timestep, text and guidance embedders and
  its output layers (the top-level modules ``FIRST_AND_LAST_LAYERS`` matches: ``x_embedder``,
  ``context_embedder``, ``time_text_embed``, ``img_in``, ``txt_in``, ``norm_out``, ``proj_out``, ``conv_in``,
  ``conv_out``, a VAE's ``encoder.conv_in`` ..., ...);
* the model's ``_keep_in_fp32_modules``, and its ``_skip_layerwise_casting_patterns`` and diffusers' default ones
  other than ``norm``. That pattern keeps normalization layers' scales in their dtype, which holds here anyway
  (they are 1-D, not linear layers); the linear inside an AdaLN norm (a Flux block's ``norm1.linear``,
  ``norm1_context.linear``, a single block's ``norm.linear``) is the block's modulation projection, a fifth to
  a third of its weights, and downloaded files quantize it, so memfit does too.

int8 rounds each chosen weight symmetrically, one scale per output row: ``scale = max|row| / 127``, each value
rounded to the nearest of -127..127. A GGUF type quantizes with the gguf package's quantizers (as those files'
converter uses them; the K-quants Q2_K to Q6_K with memfit.quant.q2_k's to q6_k's, which the gguf package
lacks). A convolution's weight is written flattened, [out, in/groups * kh * kw]: a GGUF block runs along a
row, and a kernel's width (3) is no whole block; memfit reads it back as a QuantizedConv2d
(memfit.quant.layers), which reshapes it to the kernel's shape after dequantizing. Files of an older memfit
(``WRITER_VERSION`` in memfit.models.quantize) left convolutions in their dtype.

Files are written one tensor at a time (a model never sits in memory twice): GGUF through the gguf
package's streaming writer, fp8 and int8 as a safetensors file. An int8 weight ``X.weight`` (I8, its logical
shape [out, in], a convolution's flattened) has its scales beside it as ``X.weight_scale`` (F32, shape
[out]): value = int8 * scale. fp8 writes every tensor in its own shape (one value a byte: a convolution's
4-D weight is whole blocks as it is).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from memfit.errors import MemfitError
from memfit.quant.formats import INT8_SCALE_SUFFIX

__all__ = ["FIRST_AND_LAST_LAYERS", "GGUF_TYPES", "QUANTIZE_TYPES", "SMALL_WEIGHT_ELEMENTS", "quantize_int8_rows",
           "quantized_layers", "write_quantized"]

#: --quantize's types: fp8, int8, and the GGUF ones (the name users give -> the GGUF type written).
GGUF_TYPES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k": "Q5_K", "q5_1": "Q5_1", "q5_0": "Q5_0", "q4_1": "Q4_1",
              "q4_0": "Q4_0", "q4_k": "Q4_K", "q3_k": "Q3_K", "q2_k": "Q2_K"}
QUANTIZE_TYPES = ("fp8", "int8", *GGUF_TYPES)


#: Weights this small (a value count) keep their dtype under int8 and the GGUF types: quantizing saves little.
SMALL_WEIGHT_ELEMENTS = 1024
#: A model's first and last layers (top-level module names; a VAE's encoder's and decoder's first and last
#: convolutions), which int8 and the GGUF types leave in their dtype.
FIRST_AND_LAST_LAYERS = (r"^(?:[^.]*embed[^.]*|img_in|txt_in|proj_in|proj_out|norm_out|conv_in|conv_out|final_layer"
                         r"|(?:encoder|decoder)\.(?:conv_in|conv_out))(?:\.|$)")


def _skip_patterns(module: torch.nn.Module, quant_type: str) -> tuple[str, ...]:
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    casting = (*DEFAULT_SKIP_MODULES_PATTERN, *(getattr(module, "_skip_layerwise_casting_patterns", None) or ()))
    kept_fp32 = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    if quant_type == "fp8":
        return (*casting, *kept_fp32)
    return (FIRST_AND_LAST_LAYERS, *(pattern for pattern in casting if pattern != "norm"), *kept_fp32)


#: The types that quantize convolutions too. At fewer bits a UNet's convolutions (most of SD 1.5's weights) lose
#: too much: the demo model's image fell from 30.7 to 18.9 dB PSNR at q4_0 and from 36.3 to 32.6 dB at q5_0 with
#: them quantized, where q8_0 and int8 kept 53.7 and 47.1 dB (stable-diffusion.cpp keeps them in f16 at every type).
CONVOLUTION_TYPES = ("int8", "q8_0")


def quantized_layers(module: torch.nn.Module, quant_type: str) -> dict[str, torch.nn.Module]:
    """{path: layer} of the layers of ``module`` that ``quant_type`` stores smaller (see the module docstring)."""
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    patterns = _skip_patterns(module, quant_type)
    block = _block_size(quant_type)
    found = {}

    def chosen(layer: torch.nn.Module) -> bool:
        if quant_type == "fp8":
            return True
        convolution = type(layer) is torch.nn.Conv2d and quant_type in CONVOLUTION_TYPES
        if not (type(layer) is torch.nn.Linear and layer.weight.dim() == 2 or convolution):
            # Only these stay stored when loaded (memfit.quant.layers swaps exactly these types); others, a Linear
            # subclass among them, would be dequantized then and held in floats, larger than planned.
            return False
        row = layer.weight[0].numel()  # a convolution's flattened kernel
        return row % block == 0 and layer.weight.numel() > SMALL_WEIGHT_ELEMENTS

    def walk(layer: torch.nn.Module, path: str) -> None:
        if any(re.search(pattern, path) for pattern in patterns):
            return
        if isinstance(layer, _GO_LC_SUPPORTED_PYTORCH_LAYERS):
            if chosen(layer):
                found[path] = layer
            return
        for name, child in layer.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(module, "")
    return found


def _block_size(quant_type: str) -> int:
    if quant_type in ("fp8", "int8"):
        return 1
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[GGUF_TYPES[quant_type]]][0]


def _named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a state dict of ``module`` holds, a tied one once (under its first name)."""
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor.detach()


def write_quantized(module: torch.nn.Module, quant_type: str, folder: Path) -> Path:
    """Write ``module``'s weights with its quantized_layers in ``quant_type`` into ``folder``; the file's path."""
    layers = quantized_layers(module, quant_type)
    if quant_type == "fp8":
        chosen = {f"{path}.{leaf}" for path, layer in layers.items() for leaf, _ in layer.named_parameters(recurse=False)}
        return _write_fp8(dict(_named_tensors(module)), chosen, folder / "model.safetensors")
    chosen = {f"{path}.weight" for path in layers}
    # A convolution's weight flattened to its rows (a view: nothing copied).
    tensors = {name: tensor.flatten(1) if name in chosen else tensor for name, tensor in _named_tensors(module)}
    if quant_type == "int8":
        return _write_int8(tensors, chosen, folder / "model.safetensors")
    return _write_gguf(tensors, chosen, GGUF_TYPES[quant_type], folder / "model.gguf")


def _write_gguf(tensors: dict[str, torch.Tensor], chosen: set[str], type_name: str, path: Path) -> Path:
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    writer = gguf.GGUFWriter(path, "memfit")
    planned = []
    for name, tensor in tensors.items():
        if name in chosen:
            stored = gguf.quant_shape_to_byte_shape(tuple(tensor.shape), kind)
            writer.add_tensor_info(name, stored, np.dtype(np.uint8), int(np.prod(stored)), raw_dtype=kind)
        elif tensor.dtype == torch.bfloat16:
            writer.add_tensor_info(name, tuple(tensor.shape), np.dtype(np.uint16), tensor.numel() * 2,
                                   raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            dtype = np.float16 if tensor.dtype == torch.float16 else np.float32
            writer.add_tensor_info(name, tuple(tensor.shape), np.dtype(dtype), tensor.numel() * np.dtype(dtype).itemsize)
        planned.append(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in planned:
        tensor = tensors[name]
        if name in chosen:
            writer.write_tensor_data(_gguf_blocks(tensor, kind))
        elif tensor.dtype == torch.bfloat16:
            writer.write_tensor_data(tensor.contiguous().view(torch.int16).numpy().view(np.uint16))
        else:
            writer.write_tensor_data(tensor.to(torch.float16 if tensor.dtype == torch.float16 else torch.float32)
                                     .contiguous().numpy())
    writer.close()
    return path


def _gguf_blocks(tensor: torch.Tensor, kind) -> np.ndarray:
    import gguf

    k_quants = _k_quantizers()  # the gguf package quantizes no K-quant
    if kind.name in k_quants:
        return k_quants[kind.name](tensor)
    return gguf.quants.quantize(tensor.to(torch.float32).numpy(), kind)


def _k_quantizers() -> dict:
    from memfit.quant.q2_k import quantize_q2_k
    from memfit.quant.q3_k import quantize_q3_k
    from memfit.quant.q4_k import quantize_q4_k
    from memfit.quant.q5_k import quantize_q5_k
    from memfit.quant.q6_k import quantize_q6_k

    return {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
            "Q6_K": quantize_q6_k}


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) of a [out, in] weight: symmetric, ``scale = max|row| / 127``; a row of
    zeros has scale 0."""
    weight = weight.to(torch.float32)
    scale = weight.abs().amax(dim=1) / 127.0
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(weight / divisor[:, None]).clamp(-127, 127).to(torch.int8)
    return values, scale


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
                       torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


def _write_fp8(tensors: dict[str, torch.Tensor], chosen: set[str], path: Path) -> Path:
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise MemfitError(f"--quantize ...=fp8 needs a torch with fp8 dtypes (2.1 or newer); this is {torch.__version__}.")
    entries = []
    for name, tensor in tensors.items():
        if name in chosen:
            entries.append((name, "F8_E4M3", tuple(tensor.shape), tensor.numel(), lambda t=tensor: t.to(fp8)))
        else:
            entries.append(_plain_entry(name, tensor))
    return _write_safetensors(entries, path)


def _write_int8(tensors: dict[str, torch.Tensor], chosen: set[str], path: Path) -> Path:
    entries, scales = [], {}

    def values(name: str, tensor: torch.Tensor) -> torch.Tensor:
        quantized, scales[name] = quantize_int8_rows(tensor)
        return quantized

    for name, tensor in tensors.items():
        if name not in chosen:
            entries.append(_plain_entry(name, tensor))
            continue
        rows = tensor.shape[0]
        entries.append((name, "I8", tuple(tensor.shape), tensor.numel(), lambda n=name, t=tensor: values(n, t)))
        entries.append((name + INT8_SCALE_SUFFIX, "F32", (rows,), rows * 4, lambda n=name: scales.pop(n)))
    return _write_safetensors(entries, path)


def _plain_entry(name: str, tensor: torch.Tensor) -> tuple:
    dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise MemfitError(f"{name} is a {tensor.dtype} tensor, which memfit does not write; leave out --quantize.")
    return name, dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size(), lambda: tensor


def _write_safetensors(entries: list[tuple], path: Path) -> Path:
    """A safetensors file of ``entries`` (name, dtype code, shape, bytes, a function making the tensor), each
    tensor made only when it is written."""
    header, offset = {}, 0
    for name, dtype, shape, size, _ in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        for _, _, _, _, make in entries:
            out.write(make().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return path
