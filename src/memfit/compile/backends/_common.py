"""Helpers shared by the backends: warm-up, input checks, output cleaning, graph identity."""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Sequence

from memfit.compile.backends.outputs import plain_outputs
from memfit.errors import MemfitError


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


def tensor_signature(backend: str, values: Sequence[Any]) -> list[list[Any]]:
    """``[[shape, dtype], ...]`` of ``values``, for cache keys and for checking later calls.

    Backends that compile for static shapes take tensors only: anything else would be baked into
    the graph without being part of its identity.
    """
    import torch

    signature = []
    for index, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise MemfitError(
                f"Backend {backend!r} takes tensor inputs only; input {index} is "
                f"{type(value).__name__}. Bind non-tensor arguments with functools.partial first."
            )
        signature.append([list(value.shape), str(value.dtype)])
    return signature


def check_signature(backend: str, args: Sequence[Any], signature: list[list[Any]]) -> None:
    """Refuse a call whose inputs differ from the ones the static graph was compiled for."""
    import torch

    actual = [[list(a.shape), str(a.dtype)] if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
    if actual != signature:
        raise MemfitError(
            f"Backend {backend!r} compiled this component for inputs {signature} but got {actual}; "
            "shapes are static, so compile again with example inputs of the new shape."
        )


def graph_id(fn: Callable[..., Any]) -> str:
    """What identifies the computation besides its weights: the module's class and structure,
    or the function's name and bytecode (for cache keys)."""
    import torch

    if isinstance(fn, torch.nn.Module):
        cls = type(fn)
        return f"{cls.__module__}.{cls.__qualname__}:{hashlib.sha256(repr(fn).encode()).hexdigest()[:16]}"
    code = getattr(fn, "__code__", None)
    body = hashlib.sha256(code.co_code).hexdigest()[:16] if code is not None else "nocode"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}:{body}"


def uses_store(cache: Any, weights_fingerprint: str | None) -> bool:
    """Whether compile() should key, load and save its artifact through ``cache``.

    Not with MEMFIT_CACHE=0: the store would build into a temporary directory kept until exit,
    which for a UNet is gigabytes of disk for nothing; the backend compiles in memory instead.
    """
    from memfit.cache import CacheMode

    return cache is not None and bool(weights_fingerprint) and getattr(cache, "mode", None) is not CacheMode.OFF
