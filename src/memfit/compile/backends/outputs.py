"""Make every tensor a backend returns a plain ``torch.Tensor`` on real memory.

Why: OpenVINO's model caching handed back tensor subclasses / fake tensors, and
the second generation died in ``.numpy()``. Backends pass their outputs through ``plain_outputs``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.errors import MemfitError


def plain_tensor(tensor: Any, where: str = "output") -> Any:
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if type(tensor) is torch.Tensor and not is_fake(tensor) and tensor.device.type != "meta":
        return tensor
    if is_fake(tensor) or tensor.device.type == "meta":
        raise MemfitError(
            f"The backend returned a tensor without data ({type(tensor).__name__} on "
            f"{tensor.device}) as {where}. This is a backend bug; choose another backend for "
            "this component (e.g. backend='eager') and report it."
        )
    # A subclass over real storage (e.g. nn.Parameter, or a backend's wrapper): same data,
    # plain type.
    return tensor.as_subclass(torch.Tensor)


def plain_outputs(value: Any, where: str = "output") -> Any:
    """``value`` with every tensor inside (tuples, lists, dicts, dataclasses) made plain."""
    import torch

    if isinstance(value, torch.Tensor):
        return plain_tensor(value, where)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(plain_outputs(v, f"{where}.{f}") for f, v in zip(value._fields, value)))
    if isinstance(value, (list, tuple)):
        return type(value)(plain_outputs(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        # Works for diffusers' BaseOutput too (an OrderedDict subclass); rebuild via its type.
        items = {k: plain_outputs(v, f"{where}.{k}") for k, v in value.items()}
        try:
            return type(value)(**items) if dataclasses.is_dataclass(value) else type(value)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: plain_outputs(getattr(value, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value
