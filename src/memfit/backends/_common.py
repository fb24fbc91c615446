"""Helpers shared by the backends: warm-up, input checks, output cleaning."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from memfit.backends.outputs import plain_outputs


def run_dtype(example_inputs: Sequence[Any]) -> Any:
    """The floating dtype the model runs in, read from the first floating example input."""
    import torch

    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.get_default_dtype()


def returning_plain_tensors(call: Callable[..., Any], settings: Callable[[], Any] | None = None) -> Callable[..., Any]:
    """Wrap ``call`` so its outputs are plain tensors, run inside ``settings()`` if given."""

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        if settings is None:
            return plain_outputs(call(*args, **kwargs))
        with settings():
            return plain_outputs(call(*args, **kwargs))

    return run


def warm_up(compiled: Callable[..., Any], example_inputs: Sequence[Any]) -> None:
    """Run once on the example inputs, so compile errors surface in compile(), not mid-generation."""
    import torch

    with torch.no_grad():
        compiled(*example_inputs)
