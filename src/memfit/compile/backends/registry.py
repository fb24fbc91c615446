"""Backends by name, each imported only when first asked for (like torch._dynamo's registry).

Built-in names map to "module:Class" strings so that listing names, or asking for "eager", never
imports openvino or onnxruntime. Other packages add backends through the ``memfit.compile.backends``
entry point group (the entry point loads a Backend subclass or a zero-argument factory), or at
run time with ``register_backend``.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from importlib import metadata
from typing import Callable, Union

from memfit.compile.backends.base import Availability, Backend
from memfit.errors import MemfitError

ENTRY_POINT_GROUP = "memfit.compile.backends"

_BUILTIN: dict[str, str] = {
    "eager": "memfit.compile.backends.eager:EagerBackend",
    "inductor": "memfit.compile.backends.inductor:InductorBackend",
    "openvino": "memfit.compile.backends.openvino:OpenVINOBackend",
    "onnxruntime": "memfit.compile.backends.onnxruntime:ONNXRuntimeBackend",
}

Factory = Union[str, Callable[[], Backend]]
_registered: dict[str, Factory] = {}


def register_backend(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``get_backend(name)`` build ``factory()`` (or import "module:Class")."""
    if name in _BUILTIN or (name in _registered and not replace):
        raise MemfitError(
            f"A backend named {name!r} already exists; pick another name"
            + ("" if name in _BUILTIN else " or pass replace=True")
            + "."
        )
    _registered[name] = factory


def unregister_backend(name: str) -> None:
    _registered.pop(name, None)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    found = {}
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in _BUILTIN:
            warnings.warn(
                f"Ignoring the out-of-tree backend {entry_point.name!r} ({entry_point.value}): "
                "that name belongs to a built-in memfit backend.",
                stacklevel=3,
            )
            continue
        found[entry_point.name] = entry_point
    return found


def list_backends() -> list[str]:
    """Every backend name: built-in first, then registered and entry-point ones, sorted."""
    extra = sorted(set(_registered) | set(_entry_points()))
    return list(_BUILTIN) + [name for name in extra if name not in _BUILTIN]


def get_backend(name: Union[str, Backend]) -> Backend:
    """A backend instance for ``name`` (a Backend instance is returned as it is)."""
    if isinstance(name, Backend):
        _check_compile_signature(name.name, name)
        return name
    if not isinstance(name, str):
        raise MemfitError(f"A backend is a name or a memfit Backend instance; got {type(name).__name__}.")
    factory: Factory | None = _BUILTIN.get(name) or _registered.get(name)
    if factory is None:
        entry_point = _entry_points().get(name)
        if entry_point is None:
            raise MemfitError(
                f"Unknown backend {name!r}. Valid backends: {', '.join(list_backends())}."
            )
        factory = _loaded_entry_point(entry_point)
    backend = _build(name, factory)
    if not isinstance(backend, Backend):
        raise MemfitError(
            f"Backend {name!r} was built by {factory!r} but is a {type(backend).__name__}, not a "
            "memfit.compile.backends.Backend; fix that package's memfit.compile.backends entry point."
        )
    _check_compile_signature(name, backend)
    return backend


def available_backends() -> dict[str, Availability]:
    """``{name: (ok, reason)}`` for every backend, without compiling anything."""
    result = {}
    for name in list_backends():
        try:
            result[name] = get_backend(name).available()
        except MemfitError as exc:
            result[name] = Availability(False, str(exc))
    return result


def _loaded_entry_point(entry_point: metadata.EntryPoint) -> Callable[[], Backend]:
    try:
        return entry_point.load()
    except Exception as exc:
        raise MemfitError(
            f"The out-of-tree backend {entry_point.name!r} ({entry_point.value}) failed to import: "
            f"{type(exc).__name__}: {exc}. Reinstall the package that provides it."
        ) from exc


def _check_compile_signature(name: str, backend: Backend) -> None:
    """Refuse, when it is chosen, a backend whose compile() cannot take one CompileRequest (one written for
    the earlier compile(fn, example_inputs, options, cache, weights_fingerprint)), rather than let its first
    compile fail in the middle of a generation."""
    try:
        signature = inspect.signature(backend.compile)
    except (TypeError, ValueError):  # no signature to read (a builtin): its first call will tell
        return
    try:
        signature.bind(None)
    except TypeError:
        cls = type(backend)
        raise MemfitError(
            f"Backend {name!r} ({cls.__module__}.{cls.__qualname__}) defines compile{signature}, but memfit "
            "calls compile(request) with one memfit.compile.backends.CompileRequest (request.fn, "
            "request.example_inputs, request.options, ...); update that backend's compile method."
        ) from None


def _build(name: str, factory: Factory) -> Backend:
    if isinstance(factory, str):
        module_name, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attribute)
    return factory()
