"""Quantized files of the tiny test models, written as users' files are: GGUF as city96's converter writes
it (the original key names, weights with two or more dimensions quantized when their rows are whole
blocks, the rest in F32), fp8 safetensors as Comfy's ``*_fp8_e4m3fn`` files (linear weights in fp8, the
rest as they were). The GGUF writer is the ``gguf`` package's; it quantizes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
and writes BF16 and F16. It has no K-quant quantizer: a K-quant tensor is written as random blocks with
sane scales (random_blocks), random values as the test models' weights are, which read alike in every
reader of the format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["fp8_weights", "random_blocks", "save_fp8", "save_gguf", "store_weights"]


def save_gguf(state: dict[str, torch.Tensor], path: str | Path, quant_type: str, *, architecture: str = "flux",
              keep=lambda key: False) -> Path:
    """Write ``state`` (key -> tensor) to the GGUF file ``path`` with its weights in ``quant_type`` ("Q8_0"), except
    those ``keep(key)`` keeps in F32 (as city96's converter keeps Wan's modulation tables)."""
    import gguf

    kind = gguf.GGMLQuantizationType[quant_type]
    block_size, _ = gguf.GGML_QUANT_SIZES[kind]
    path = Path(path)
    writer = gguf.GGUFWriter(path, architecture)
    for key, tensor in state.items():
        values = tensor.detach().to(torch.float32).contiguous().numpy()
        if tensor.ndim >= 2 and tensor.shape[-1] % block_size == 0 and not keep(key):
            data = random_blocks(quant_type, tuple(tensor.shape)) if quant_type in _K_HALVES else \
                gguf.quants.quantize(values, kind)
            writer.add_tensor(key, data, raw_dtype=kind)
        else:
            writer.add_tensor(key, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Where each block keeps its fp16 scales (d, and dmin or m where it has one), in bytes from its start.
_K_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_HALVES = {**_K_HALVES, "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}


def random_blocks(quant_type: str, shape: tuple[int, ...], seed: int = 0, scale: float = 1 / 64) -> np.ndarray:
    """The bytes of a tensor of logical ``shape`` in ``quant_type``: random quants (and sub-block scales), fp16
    scales of about ``scale`` (so values stay finite). For K-quants, which the gguf package cannot quantize, and
    for real-size benchmark files, written at the speed of a random generator."""
    import gguf

    kind = gguf.GGMLQuantizationType[quant_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = int(np.prod(shape)) // block_size
    data = np.random.default_rng(seed).integers(0, 256, size=(blocks, type_size), dtype=np.uint8)
    halves = np.random.default_rng(seed + 1).uniform(0.5, 1.5, size=(blocks, len(_HALVES[quant_type]))) * scale
    for column, offset in enumerate(_HALVES[quant_type]):
        data[:, offset:offset + 2] = halves[:, column].astype(np.float16).reshape(-1, 1).view(np.uint8)
    return data.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def fp8_weights(state: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float8_e4m3fn, keep=lambda key: False,
                scaled: bool = False) -> dict[str, torch.Tensor]:
    """``state`` as an fp8 file holds it: every weight of two dimensions in ``dtype`` except those ``keep(key)``
    keeps (Comfy's "fp8_mixed" files); ``scaled``: each divided by a float32 ``scale_weight`` stored beside it that
    brings its largest value to the format's largest, with Comfy's ``scaled_fp8`` marker (its "scaled" files)."""
    out = {}
    for key, tensor in state.items():
        if not (tensor.ndim == 2 and key.endswith(".weight")) or keep(key):
            out[key] = tensor.contiguous()
            continue
        if scaled:
            scale = (tensor.abs().max().to(torch.float32) / torch.finfo(dtype).max).clamp(min=1e-12)
            out[key.removesuffix("weight") + "scale_weight"] = scale
            tensor = tensor / scale
        out[key] = tensor.to(dtype).contiguous()
    if scaled:
        out["scaled_fp8"] = torch.empty(0, dtype=dtype)
    return out


def save_fp8(state: dict[str, torch.Tensor], path: str | Path, **options) -> Path:
    """Write ``state`` to the safetensors file ``path`` as fp8_weights(state, **options) holds it."""
    from safetensors.torch import save_file

    save_file(fp8_weights(state, **options), str(path))
    return Path(path)



def store_weights(module: torch.nn.Module, kind: str, names) -> torch.nn.Module:
    """``module`` with its Linear layers ``names`` turned into memfit's stored-weight layers holding their weights
    as ``kind`` ("int8", or a type the gguf package quantizes: Q8_0, Q4_0, ...) and their biases as they were, as
    memfit loads them from such a file; returns ``module``."""
    from memfit.quant.formats import INT8_FORMAT, StoredTensor, readable_gguf_types
    from memfit.quant.layers import use_stored_layers
    from memfit.quant.writers import quantize_int8_rows

    stored, data = {}, {}
    for name in names:
        layer = module.get_submodule(name)
        weight = layer.weight.detach()
        if kind == "int8":
            values, scale = quantize_int8_rows(weight)
            stored[f"{name}.weight"] = StoredTensor(INT8_FORMAT, tuple(weight.shape), scale)
        else:
            import gguf

            fmt = next(f for f in readable_gguf_types().values() if f.name == kind)
            blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[kind])
            values = torch.from_numpy(blocks).view(torch.int8)
            stored[f"{name}.weight"] = StoredTensor(fmt, tuple(weight.shape))
        data[name] = (values, layer.bias.detach().clone())
    use_stored_layers(module, stored)  # new layers, empty: loading fills them
    for name, (values, bias) in data.items():
        layer = module.get_submodule(name)
        layer.weight.data, layer.bias.data = values, bias
    return module
