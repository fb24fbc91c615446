"""Quantized files of the tiny test models, written as users' files are: GGUF as city96's converter writes
it (the original key names, weights with two or more dimensions quantized when their rows are whole
blocks, the rest in F32), fp8 safetensors as Comfy's ``*_fp8_e4m3fn`` files (linear weights in fp8, the
rest as they were). The GGUF writer is the ``gguf`` package's; it writes the types it can quantize
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["save_fp8", "save_gguf"]


def save_gguf(state: dict[str, torch.Tensor], path: str | Path, quant_type: str, *, architecture: str = "flux") -> Path:
    """Write ``state`` (key -> tensor) to the GGUF file ``path`` with its weights in ``quant_type`` ("Q8_0")."""
    import gguf

    kind = gguf.GGMLQuantizationType[quant_type]
    block_size, _ = gguf.GGML_QUANT_SIZES[kind]
    path = Path(path)
    writer = gguf.GGUFWriter(path, architecture)
    for key, tensor in state.items():
        values = tensor.detach().to(torch.float32).contiguous().numpy()
        if tensor.ndim >= 2 and tensor.shape[-1] % block_size == 0:
            writer.add_tensor(key, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(key, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_fp8(state: dict[str, torch.Tensor], path: str | Path, *, dtype: torch.dtype = torch.float8_e4m3fn,
             keep=lambda key: False) -> Path:
    """Write ``state`` to the safetensors file ``path`` with every weight of two dimensions in ``dtype``, except
    those ``keep(key)`` keeps as they are (Comfy's "fp8_mixed" files)."""
    from safetensors.torch import save_file

    out = {key: (tensor.to(dtype) if tensor.ndim == 2 and key.endswith(".weight") and not keep(key) else tensor)
           .contiguous() for key, tensor in state.items()}
    save_file(out, str(path))
    return Path(path)


_ = np  # the gguf package's quantizers take and give numpy arrays
