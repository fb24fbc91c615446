"""The weight dtypes memfit runs in, by the names its options use ("fp32", "bf16", "fp16")."""

from __future__ import annotations

import torch

from memfit.errors import MemfitError

__all__ = ["DTYPES", "dtype_name", "parse_dtype"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise MemfitError(f"Unknown dtype {name!r}; use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | str) -> str:
    """The option name of ``dtype`` (a name passes through as it is; a torch dtype memfit has no name for gives
    its own, "torch.float64")."""
    if isinstance(dtype, str):
        return dtype
    return _NAMES.get(dtype, str(dtype))
