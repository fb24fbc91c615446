"""Compile the entry points a pipeline actually calls, per component, with a backend per component.

    records = compile_components(pipe, "openvino", fallback="eager")
    records = compile_components(pipe, {"unet": "openvino", "vae": "eager"})
    uncompile(pipe)                      # every compiled entry point removed, the modules as before

``torch.compile(vae)`` compiles nothing a pipeline uses: pipelines call ``vae.decode``. So memfit
installs, as *instance attributes* (removable, the class untouched), a compiled callable for

    denoiser (unet / transformer / prior)   forward
    vae                                     decode, and encode where the module has it
    text encoders                           forward

Every backend compiles from example inputs, so an entry compiles lazily on its first call, from
the real inputs the pipeline passes (the only inputs that matter). Arguments are flattened with
torch's pytree: tensors become the compiled function's positional inputs, everything else (None,
flags, return_dict, a generator object) is baked in and part of the input signature; a new
signature compiles again (at most MAX_SIGNATURES per entry, then that signature runs eagerly).

Failure: a backend that cannot compile raises MemfitError naming the component, the entry point
and the backend; with ``fallback="eager"`` the entry runs eagerly instead and its CompileRecord
says so, with the reason. Records are live objects: a lazy compile updates them on first call.

Weights: a backend whose compiled model holds its own copy of the weights (``holds_own_weights``:
openvino, onnxruntime) leaves the torch parameters unused, so they are memory-mapped from the
component's safetensors as soon as its entries are installed (memfit.compile.weights) and read only
under ``FileWeights.held()``: by a compile (which hands them back before the compiled model loads)
or an eager fallback (which brings them back into memory for good). The records say where they are.

Cache keys (for backends that use memfit's store, e.g. onnxruntime) come from content only: the
component's weights fingerprint (its folder's, from the staged runner, or a hash of the module's
tensors), the module class and entry point, the baked-in arguments, the input signature, the
backend, its options and library versions. Never the part name, so one VAE shared by two
pipelines maps to one cache entry.
"""

from __future__ import annotations

import hashlib
import json
import time
import types
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Union

import torch

from memfit.cache import CacheMode
from memfit.compile.backends import Backend, CompileRequest, get_backend
from memfit.compile.precision import with_precision
from memfit.compile.weights import FileWeights
from memfit.dtypes import DTYPES, dtype_name
from memfit.errors import MemfitError
from memfit.text_enum import TextEnum
from memfit.sizes import format_bytes as _size

__all__ = ["ENTRIES_ATTR", "CompileRecord", "CompileStatus", "compile_blocks", "compile_components", "compile_stage",
           "compiled_in_store", "compiled_weight_bytes", "entry_points", "is_compiled", "module_fingerprint",
           "parse_backend_arg", "release_buffers", "report_records", "served_by_own_weights", "uncompile",
           "without_components"]

BackendSpec = Union[str, Backend, Mapping[str, Union[str, Backend]]]

# Attributes on a compiled module: {method name: _Entry}, and its FileWeights where released.
ENTRIES_ATTR = "_memfit_compiled"
WEIGHTS_ATTR = "_memfit_file_weights"
MAX_SIGNATURES = 8
# The manifest field a stored compiled model names its component's weights fingerprint in.
STORED_WEIGHTS_TAG = "component_weights"
_MISSING = object()

_DENOISERS = ("unet", "transformer", "prior", "decoder")


def entry_points(name: str, module: torch.nn.Module) -> tuple[str, ...]:
    """The methods of component ``name`` that a diffusers pipeline calls (empty: not compiled)."""
    if not isinstance(module, torch.nn.Module):
        return ()
    if name.startswith("vae"):
        return tuple(m for m in ("decode", "encode") if callable(getattr(module, m, None)))
    if name.startswith(_DENOISERS + ("text_encoder",)):
        return ("forward",)
    return ()


class CompileStatus(TextEnum):
    """What became of an entry point; its value is what a record's JSON says."""

    PENDING = "pending"  # compiles on its first call
    COMPILED = "compiled"
    FALLBACK = "fallback"  # ran with ``backend_used`` instead; the record's ``reason`` says why
    SHARED = "shared"  # already compiled through another pipeline holding the same module object


@dataclass
class CompileRecord:
    """What happened to one entry point (``status``: see CompileStatus)."""

    component: str
    entry: str
    backend: str
    backend_used: str
    status: CompileStatus = CompileStatus.PENDING
    reason: str = ""
    compile_seconds: float = 0.0
    signatures: int = 0
    cold: bool = False  # built the artifact here (no stored one): the expensive path
    weights: str = ""  # where the torch weights are while the compiled model serves the component, in words
    # Whether those torch weights are memory-mapped from the component's files (not in memory). Not in to_dict(),
    # whose JSON keeps the fields it always had; ``weights`` says the same in words there.
    weights_mapped: bool = False

    def __post_init__(self) -> None:
        self.status = CompileStatus(self.status)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["status"] = self.status.value
        del data["weights_mapped"]
        return data

    def __str__(self) -> str:
        text = f"{self.component}.{self.entry}: {self.backend}"
        if self.status is CompileStatus.FALLBACK:
            text += f" failed, ran {self.backend_used} ({self.reason})"
        elif self.status is CompileStatus.COMPILED:
            text += f" compiled in {self.compile_seconds:.2f} s"
        else:
            text += f" {self.status.value}"
        return text


def compile_components(
    pipe,
    backend: BackendSpec,
    *,
    fallback: str | Backend | None = None,
    cache: Any = None,
    fingerprints: Mapping[str, str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    sources: Mapping[str, Any] | None = None,
    precision: str | None = None,
    run_dtypes: Mapping[str, torch.dtype] | None = None,
) -> list[CompileRecord]:
    """Install compiled entry points on every torch component of ``pipe``; see the module doc.

    backend:      a name, a Backend, or {component: name or Backend}; in a dict, "*" is the
                  default for components not named, and components not covered stay as they are.
    fallback:     None (a backend failure raises) or "eager" (the entry runs as plain PyTorch).
    cache:        a CacheStore; None opens the one the environment configures; False: no store.
    fingerprints: {component: weights fingerprint} when the caller knows the content (e.g. the
                  component's folder fingerprint); otherwise hashed from the module's tensors.
    options:      {backend name: options} passed to that backend's compile.
    sources:      {component: folder of its safetensors files}; a component compiled with a backend
                  that holds its own copy of the weights (``Backend.holds_own_weights``) gets its torch
                  weights memory-mapped from there (memfit.compile.weights); otherwise from the folder
                  its config names, and where neither holds them, they stay in memory (the record says so).
    precision:    the compute precision ("fp32", "bf16", "fp16") for backends that have one of their
                  own (OpenVINO); None: the dtype the component runs in. See ``with_precision``.
    run_dtypes:   {component: the dtype it runs in} for components loaded in their files' dtype instead
                  (memfit.run.runner skips that conversion for a component its compiled model serves);
                  see memfit.compile.weights.
    """
    components = {name: value for name, value in getattr(pipe, "components", {}).items()}
    run_dtypes = run_dtypes or {}
    if precision is not None:
        backend = with_precision(backend, precision, _weights_dtype(components, run_dtypes))
    chosen = _choose_backends(components, backend)
    fallback_backend, cache = _fallback_backend(fallback), _store(cache)
    records: list[CompileRecord] = []
    for name, spec in chosen.items():
        module = components.get(name)
        methods = entry_points(name, module)
        if methods:
            be = get_backend(spec)
            records += _install(module, name, methods, be, fallback_backend, cache, (fingerprints or {}).get(name),
                                options or {}, (sources or {}).get(name),
                                run_dtypes.get(name))
    for name, dtype in run_dtypes.items():
        module = components.get(name)
        if isinstance(module, torch.nn.Module) and not getattr(vars(module).get(WEIGHTS_ATTR), "released", False):
            module.to(dtype)  # no compiled model serves it from its files: it runs in memory, as loaded converted
    return records


def compile_blocks(module: torch.nn.Module, component: str, paths, backend: str | Backend, *, fallback=None,
                   cache: Any = None, fingerprint: str | None = None, source=None,
                   run_dtype: torch.dtype | None = None, method: str = "forward") -> list[CompileRecord]:
    """Compile the ``forward`` (or ``method``) of the submodules ``paths`` of ``module`` (component ``component``), each
    as a model of its own, while ``module``'s own forward runs as plain PyTorch: a component whose
    compiled model does not fit a budget whole runs its largest blocks compiled and streams the rest
    (memfit.run.runner). Each block's torch weights are memory-mapped from ``source`` (the component's
    folder) like a whole component's; its records are named "component/path". ``fingerprint``: the
    component's weights fingerprint (each block's key adds its path). Undone by ``uncompile(module)``.
    ``method``: another callable the submodules carry as an instance attribute (the compiled banded decode's
    band kernels: memfit.run.compiled_banded_decode).
    """
    be, fallback_backend, cache = get_backend(backend), _fallback_backend(fallback), _store(cache)
    # Many block models would each keep their own intermediate buffers between calls, so each frees them after
    # its call. A whole component keeps its buffers between calls (a Session's pool frees them when a stage
    # needs the room: release_buffers): freeing them after each call would not lower the stage's peak.
    options = {be.name: {"release_memory": True}} if "release_memory" in be.default_options else {}
    records = []
    for path in paths:
        block_fingerprint = None
        if fingerprint is not None:
            block_fingerprint = hashlib.sha256(f"{fingerprint}\0{path}".encode()).hexdigest()
        records += _install(module.get_submodule(path), f"{component}/{path}", (method,), be, fallback_backend,
                            cache, block_fingerprint, options, source, run_dtype, key_prefix=path + ".")
    return records


def _fallback_backend(fallback: str | Backend | None) -> Backend | None:
    fallback_backend = get_backend(fallback) if fallback is not None else None
    if fallback_backend is not None and fallback_backend.name != "eager":
        raise MemfitError(f"fallback={fallback_backend.name!r} is not supported; the fallback is 'eager' (or None to raise).")
    return fallback_backend


def _store(cache: Any) -> Any:
    """The CacheStore compiles use: ``cache`` itself, the environment's (None), or none (False)."""
    if cache is None:
        from memfit.cache import open_store

        return open_store()
    return None if cache is False else cache


def _install(module, name, methods, be, fallback_backend, cache, fingerprint, options, source, run_dtype,
             key_prefix: str = "") -> list[CompileRecord]:
    """Install compiled ``methods`` of one module (a component, or a block of one named "component/path")."""
    records: list[CompileRecord] = []
    ok, why = be.available()
    installed = vars(module).setdefault(ENTRIES_ATTR, {})
    weights = vars(module).get(WEIGHTS_ATTR)
    if weights is None and ok and be.holds_own_weights:
        weights = FileWeights(module, source, run_dtype, key_prefix=key_prefix)
        vars(module)[WEIGHTS_ATTR] = weights
    for method in methods:
        existing = installed.get(method)
        if existing is not None:
            if existing.backend.name != be.name:
                raise MemfitError(
                    f"{name}.{method} is already compiled with backend {existing.backend.name!r} (the module is "
                    f"shared with another pipeline); call memfit.compile.entry_points.uncompile on it before choosing {be.name!r}."
                )
            records.append(CompileRecord(name, method, be.name, existing.record.backend_used, CompileStatus.SHARED))
            continue
        record = CompileRecord(name, method, be.name, be.name)
        if not ok:
            reason = f"backend {be.name!r} is not available: {why}"
            if fallback_backend is None:
                raise MemfitError(f"Cannot compile {name}.{method}: {reason}. Pass fallback='eager' (--fallback eager) or choose another backend for {name}.")
            record.status, record.backend_used, record.reason = CompileStatus.FALLBACK, fallback_backend.name, reason
            be_used = fallback_backend
        else:
            be_used = be
        entry = _Entry(module, method, name, record, be_used, fallback_backend, cache, fingerprint,
                       options.get(be_used.name), weights if be_used is be else None)
        entry.install()
        installed[method] = entry
        records.append(record)
    if not installed:
        vars(module).pop(ENTRIES_ATTR, None)
    if weights is not None and any(e.weights is weights for e in installed.values()):
        # From now on only a compile or an eager fallback reads them (under weights.held()).
        mapped = weights.release()
        if not mapped:
            where = f"torch weights kept in memory: {weights.kept_because}"
        else:
            where = f"torch weights ({_size(weights.released_bytes)}) memory-mapped from {weights.folder}, not in memory"
        for record in records:
            if record.status is not CompileStatus.SHARED:
                record.weights, record.weights_mapped = where, mapped
    return records


def uncompile(pipe_or_module) -> None:
    """Remove every compiled entry point memfit installed; the modules are exactly as before."""
    if isinstance(pipe_or_module, torch.nn.Module):
        modules = [pipe_or_module]
    else:
        modules = [m for m in getattr(pipe_or_module, "components", {}).values() if isinstance(m, torch.nn.Module)]
    for component in modules:
        for module in component.modules():  # a component compiled whole, or block by block (compile_blocks)
            entries = vars(module).pop(ENTRIES_ATTR, None) or {}
            for entry in entries.values():
                entry.uninstall()
            weights = vars(module).pop(WEIGHTS_ATTR, None)
            if weights is not None:
                weights.restore()


def is_compiled(pipe_or_module) -> bool:
    if isinstance(pipe_or_module, torch.nn.Module):
        return any(vars(module).get(ENTRIES_ATTR) for module in pipe_or_module.modules())
    return any(is_compiled(m) for m in getattr(pipe_or_module, "components", {}).values() if isinstance(m, torch.nn.Module))


def parse_backend_arg(text: str) -> BackendSpec:
    """CLI form: "openvino" or "unet=openvino,vae=eager" (a bare name among pairs is the default)."""
    text = text.strip()
    if "=" not in text:
        return text
    spec: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            name, value = "*", name
        if not name.strip() or not value.strip():
            raise MemfitError(f"--backend {text!r}: each item is COMPONENT=BACKEND (e.g. unet=openvino,vae=eager).")
        spec[name.strip()] = value.strip()
    return spec


def module_fingerprint(module: torch.nn.Module) -> str:
    """A content digest of a live module: its config and every tensor (name, dtype, shape, bytes;
    large tensors sampled), so equal weights under any part name fingerprint the same."""
    digest = hashlib.sha256(b"memfit-module/1")
    config = getattr(module, "config", None)
    if config is not None:
        try:
            items = dict(config.to_dict() if hasattr(config, "to_dict") else config)
            items.pop("_name_or_path", None)
            # diffusers lists the defaulted keys in set order, which differs between processes
            # (string hashing is salted); the values themselves are all in the config anyway.
            items.pop("_use_default_values", None)
            digest.update(json.dumps(items, sort_keys=True, default=str).encode())
        except Exception:  # an exotic config: the tensors still identify the weights
            pass
    for prefix, tensors in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for tensor_name, tensor in tensors:
            digest.update(f"\0{prefix}:{tensor_name}:{tensor.dtype}:{list(tensor.shape)}".encode())
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            flat = tensor.detach().reshape(-1)
            if flat.numel() > 1 << 16:  # sample 32 evenly spaced runs of 2048 elements
                step = flat.numel() // 32
                flat = torch.cat([flat[i * step : i * step + 2048] for i in range(32)])
            flat = flat.cpu().contiguous()
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes())
    return digest.hexdigest()


# --- internals ---------------------------------------------------------------------------------


def _choose_backends(components: Mapping[str, Any], backend: BackendSpec) -> dict[str, str | Backend]:
    if isinstance(backend, Mapping):
        unknown = sorted(set(backend) - set(components) - {"*"})
        if unknown:
            raise MemfitError(
                f"Backend given for {', '.join(unknown)}, which this pipeline does not have; "
                f"its components are: {', '.join(components)}."
            )
        default = backend.get("*")
        chosen = {}
        for name in components:
            spec = backend.get(name, default)
            if spec is not None:
                chosen[name] = spec
        return chosen
    return {name: backend for name in components}


def _weights_dtype(components: Mapping[str, Any], run_dtypes: Mapping[str, torch.dtype]) -> Any:
    """The dtype the pipeline's weights run in: its first floating parameter's."""
    for name, module in components.items():
        if name in run_dtypes:
            return run_dtypes[name]
        if isinstance(module, torch.nn.Module):
            for param in module.parameters():
                if param.is_floating_point():
                    return param.dtype
    return torch.get_default_dtype()


def _leaf_signature(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Generator):
        # A trace cannot keep drawing from a generator, so no compiled graph depends on which one
        # is passed (the store's key already ignores it). Keyed by identity, every image's new
        # generator compiled the entry again (a pipeline hands its generator to vae.decode) and the
        # ninth image ran it eagerly.
        return "<Generator>"
    # Any other object: baked in by identity; the entry keeps a reference to it.
    return f"<{type(value).__qualname__}@{id(value)}>"


def _content_signature(value: Any) -> Any:
    """Like _leaf_signature, but stable across processes (for cache keys)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object: dynamo caches compiled frames per code object,
    so without this every entry and signature would share one cache (and its recompile limit),
    and old modules would stay reachable from it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class _Entry:
    """The compiled stand-in for one bound method; compiles per input signature on first use."""

    def __init__(self, module, method, component, record, backend, fallback, cache, fingerprint, options,
                 weights=None):
        self.module = module
        self.method = method
        self.component = component
        self.record = record
        self.backend = backend
        self.fallback = fallback
        self.cache = cache
        self.fingerprint = fingerprint
        self.options = options
        self.previous = vars(module).get(method, _MISSING)
        self.original = getattr(module, method)  # bound method (or an earlier instance override)
        self.compiled: dict[Any, tuple[Callable, Any, list]] = {}
        self.failed = record.status is CompileStatus.FALLBACK
        self.weights = weights  # FileWeights: the torch weights mapped from disk while compiled code runs

    # install / uninstall -----------------------------------------------------------------------

    def install(self) -> None:
        vars(self.module)[self.method] = self

    def uninstall(self) -> None:
        if vars(self.module).get(self.method) is self:
            if self.previous is _MISSING:
                del vars(self.module)[self.method]
            else:
                vars(self.module)[self.method] = self.previous
        self.compiled.clear()

    # calls -------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_positions]
        signature = (
            str(spec),
            tuple((i, _leaf_signature(leaf)) for i, leaf in enumerate(leaves) if i not in set(tensor_positions)),
            tuple((tuple(t.shape), str(t.dtype), str(t.device)) for t in tensors),
        )
        compiled = self.compiled.get(signature)
        if compiled is None:
            if self.failed or len(self.compiled) >= MAX_SIGNATURES:
                if not self.failed and self.record.reason == "":
                    self.record.reason = f"more than {MAX_SIGNATURES} input signatures; new ones run eagerly"
                return self._eager(args, kwargs)
            compiled = self._compile(spec, leaves, tensor_positions, tensors, args, kwargs)
            if compiled is None:
                return self._eager(args, kwargs)
            self.compiled[signature] = compiled
        run, _keep = compiled
        try:
            return run(*tensors)
        except Exception as exc:
            return self._failed_call(exc, args, kwargs)

    def _eager(self, args, kwargs):
        if self.weights is None:
            return self.original(*args, **kwargs)
        with self.weights.held():
            return self.original(*args, **kwargs)

    def _tensor_function(self, spec, leaves, tensor_positions):
        """The entry as a function of its tensor inputs only; the other arguments are baked in."""
        from torch.utils._pytree import tree_unflatten

        original = self.original
        template = list(leaves)
        for i in tensor_positions:
            template[i] = None

        def call_with_tensors(*tensors):
            filled = list(template)
            for i, tensor in zip(tensor_positions, tensors):
                filled[i] = tensor
            call_args, call_kwargs = tree_unflatten(filled, spec)
            return original(*call_args, **call_kwargs)

        return _fresh_function(call_with_tensors)

    def _entry_fingerprint(self, leaves, tensor_positions, spec) -> str:
        weights = self.fingerprint or module_fingerprint(self.module)
        cls = type(self.module)
        param = next(iter(self.module.parameters()), None)
        parts = {
            "weights": weights,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "entry": self.method,
            "weights_dtype": str(param.dtype) if param is not None else None,
            "args": str(spec),
            "constants": [_content_signature(leaf) for i, leaf in enumerate(leaves) if i not in set(tensor_positions)],
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def _compile(self, spec, leaves, tensor_positions, tensors, args, kwargs):
        fn = self._tensor_function(spec, leaves, tensor_positions)
        started = time.perf_counter()
        built: list[bool] = []
        cache = self.cache
        if self.fingerprint is not None and hasattr(cache, "tagged"):
            cache = cache.tagged(**{STORED_WEIGHTS_TAG: self.fingerprint})  # see compiled_in_store
        try:
            if self.weights is None:
                fingerprint = self._entry_fingerprint(leaves, tensor_positions, spec) if self.cache is not None else None
                run = self.backend.compile(CompileRequest(fn, tensors, self.options, cache, fingerprint,
                                                          module=self.module))
            else:
                # A cold build reads them, so they are brought in when it starts; a stored artifact does not.
                with self.weights.held(until_needed=True) as bring_in:
                    if self.fingerprint is None:
                        bring_in()  # the key then hashes the weights as the module runs them
                    fingerprint = self._entry_fingerprint(leaves, tensor_positions, spec) if self.cache is not None else None
                    run = self.backend.compile(CompileRequest(
                        fn, tensors, self.options, cache, fingerprint,
                        on_build=lambda: (built.append(True), bring_in()), before_load=self.weights.drop,
                        module=self.module,
                    ))
        except Exception as exc:
            if isinstance(exc, MemfitError) and "MEMFIT_CACHE=require" in str(exc):
                raise
            self._fail(exc)
            return None
        self.record.compile_seconds += time.perf_counter() - started
        self.record.signatures += 1
        self.record.cold = self.record.cold or bool(built)
        if self.record.status is CompileStatus.PENDING:
            self.record.status = CompileStatus.COMPILED
        # Keep baked-in objects alive so their ids (in the signature) are never reused.
        return run, [leaf for i, leaf in enumerate(leaves) if i not in set(tensor_positions)]

    def _fail(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip()
        if len(reason) > 500:
            reason = reason[:497] + "..."
        if self.fallback is None:
            raise MemfitError(
                f"Backend {self.backend.name!r} failed on component {self.component!r} ({self.component}.{self.method}): "
                f"{reason}. Pass fallback='eager' (CLI --fallback eager) to run it eagerly, or choose another "
                f"backend for it, e.g. backend={{'{self.component}': 'eager', ...}}."
            ) from exc
        self.failed = True
        self.compiled.clear()
        if self.weights is not None:
            self.weights.restore()  # every call now runs eagerly: the weights belong in memory
            self.record.weights, self.record.weights_mapped = "torch weights in memory (eager fallback)", False
        self.record.status = CompileStatus.FALLBACK
        self.record.backend_used = "eager"
        self.record.reason = reason

    def _failed_call(self, exc: Exception, args, kwargs):
        if isinstance(exc, MemfitError) and self.fallback is None:
            raise MemfitError(f"{self.component}.{self.method} (backend {self.backend.name!r}): {exc}") from exc
        self._fail(exc)
        return self._eager(args, kwargs)

    def __repr__(self) -> str:
        return (f"<memfit compiled {self.component}.{self.method} backend={self.backend.name!r} "
                f"status={self.record.status.value}>")


# --- used by the staged runner (memfit.run.generate) ------------------------------------------------


def compile_stage(pipe, model_dir, backend: BackendSpec | None, fallback, records: list,
                  fingerprint: Callable[[str], str], run_dtypes: Mapping[str, torch.dtype] | None = None) -> None:
    """Compile a freshly loaded stage's components, with their folders' fingerprints as content.

    ``records`` receives the CompileRecords; they fill in as the entries compile during the stage.
    ``fingerprint(name)`` is the content fingerprint of the folder ``model_dir/name``. ``run_dtypes``: see
    compile_components.
    """
    if backend is None:
        return
    from pathlib import Path

    fingerprints, sources = {}, {}
    for name, module in getattr(pipe, "components", {}).items():
        if entry_points(name, module) and (Path(model_dir) / name).is_dir():
            fingerprints[name] = fingerprint(name)
            sources[name] = Path(model_dir) / name
    records.extend(compile_components(pipe, backend, fallback=fallback, fingerprints=fingerprints, sources=sources,
                                      run_dtypes=run_dtypes))


def served_by_own_weights(all_names, names, backend: BackendSpec | None) -> dict[str, Backend]:
    """{component: its backend} for the components of ``names`` (a stage of a pipeline with components
    ``all_names``; they need not be loaded yet) that ``backend`` compiles into a model with its own copy
    of the weights: their torch weights serve only a cold compile or an eager fallback (see
    compile_components' ``run_dtypes``)."""
    if backend is None:
        return {}
    served = {}
    for name, spec in _choose_backends(dict.fromkeys(all_names), backend).items():
        if name not in names or not name.startswith(_DENOISERS + ("vae", "text_encoder")):  # see entry_points
            continue
        be = get_backend(spec)
        if be.holds_own_weights and be.available().ok:
            served[name] = be
    return served


def release_buffers(pipe) -> None:
    """Free the intermediate buffers of ``pipe``'s compiled models, whole or in blocks, where their backend
    keeps them between calls (OpenVINO): for a pipeline kept loaded between runs under a budget, whose
    next call allocates them again. A denoiser's are as large as a VAE decode's at the same size."""
    for component in getattr(pipe, "components", {}).values():
        if not isinstance(component, torch.nn.Module):
            continue
        for module in component.modules():
            for entry in vars(module).get(ENTRIES_ATTR, {}).values():
                for run, _ in entry.compiled.values():
                    release = getattr(run, "release_buffers", None)
                    if release is not None:
                        release()


def compiled_in_store(fingerprints: Mapping[str, str], backends: Mapping[str, Backend], cache: Any = None) -> set[str]:
    """The components of ``backends`` ({component: its backend}, e.g. from served_by_own_weights) of which
    the store already holds a model compiled with that backend from the weights ``fingerprints`` names:
    their first call imports it, where a build peaks at several times its size. Matched by weights and
    backend only, so a model stored for another input shape, precision or library version counts too (a
    first call with those still builds)."""
    store = _store(cache)
    if store is None or getattr(store, "mode", None) is CacheMode.OFF or not backends:
        return set()
    try:
        held = {(entry.meta.get(STORED_WEIGHTS_TAG), entry.parts.get("backend")) for entry in store.ls("compiled")}
    except OSError:  # an unreadable store: every build is a cold one
        return set()
    return {name for name, be in backends.items() if (fingerprints.get(name), be.name) in held}


def compiled_weight_bytes(pipe, names, backend: BackendSpec | None, dtype: torch.dtype) -> dict[str, int]:
    """{component: bytes its compiled model holds} for the components of ``names`` whose backend keeps
    its own copy of the weights (their torch weights are then memory-mapped, not in memory): every
    parameter at the precision the backend holds it in (Backend.held_precision: its compute precision, or
    ``dtype`` where it has none set; f32 where its device cannot compute in that), but a quantized linear layer's
    stored bytes (the parameters that are not floats) at their own size where the backend keeps them compressed
    (``Backend.stored_formats``). A convolution's stored bytes count at the held precision: OpenVINO's CPU plugin
    folds a convolution's pattern into floats when it compiles (a byte per value or a little more: counted a
    little high). A budget counts this, not the torch weights, for such a component: it cannot be streamed block
    by block."""
    components = dict(getattr(pipe, "components", {}))
    costs = {}
    for name, be in served_by_own_weights(components, names, backend).items():
        module = components[name]
        if not entry_points(name, module):
            continue
        held = DTYPES.get(be.held_precision(dtype_name(dtype)), torch.float32)  # a dtype memfit has no name for: f32
        costs[name] = sum(p.numel() * (p.element_size() if be.stored_formats and not p.is_floating_point()
                                       and not isinstance(layer, torch.nn.Conv2d) else held.itemsize)
                          for layer in module.modules() for p in layer.parameters(recurse=False))
    return costs


def without_components(backend: BackendSpec | None, names) -> BackendSpec | None:
    """``backend`` with the components ``names`` left uncompiled (they run as plain PyTorch)."""
    if backend is None or not names:
        return backend
    spec = dict(backend) if isinstance(backend, Mapping) else {"*": backend}
    spec.update({name: None for name in names})
    return spec


def report_records(report, records: list) -> None:
    """Attach a finished stage's records to its StageReport; a fallback also becomes a run note."""
    if not records or not report.stages:
        return
    stage = report.stages[-1]
    stage.compiled = [record.to_dict() for record in records]
    blocks: dict[str, list[CompileRecord]] = {}  # a component's blocks (compile_blocks) get one note
    for record in records:
        if "/" in record.component and record.status is CompileStatus.COMPILED and record.backend != "eager":
            blocks.setdefault(record.component.split("/")[0], []).append(record)
            continue
        if record.status is CompileStatus.FALLBACK:
            report.notes.append(
                f"{stage.stage}: {record.component}.{record.entry} fell back from {record.backend} to "
                f"{record.backend_used}: {record.reason}"
            )
        elif record.status is CompileStatus.COMPILED and record.backend != "eager":
            how = "loaded from memfit's store"
            if record.cold:
                # A budget counts the build (memfit.run.runner): the note is for runs without one, whose user may
                # wonder why the first run needs more than later ones.
                how = ("built (no stored artifact: it read the torch weights from the files and compiled them, which "
                       "the budget counts as the model plus its build; later runs import it)")
            report.notes.append(
                f"{stage.stage}: {record.component}.{record.entry} compiled with {record.backend} in "
                f"{record.compile_seconds:.2f} s, {how}" + (f"; {record.weights}" if record.weights else "")
            )
    for component, done in blocks.items():
        built = sum(record.cold for record in done)
        mapped = all(record.weights_mapped for record in done)
        report.notes.append(
            f"{stage.stage}: {len(done)} blocks of {component} compiled with {done[0].backend} in "
            f"{sum(record.compile_seconds for record in done):.2f} s, {len(done) - built} loaded from memfit's store, "
            f"{built} built" + ("; their torch weights memory-mapped, not in memory" if mapped else "")
        )
