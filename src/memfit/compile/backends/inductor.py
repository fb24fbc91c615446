"""torch.compile with TorchInductor: fused kernels generated for this machine's CPU or GPU.

What is stored: given ``cache=`` (a store that is on), a ``weights_fingerprint`` and tensor
inputs, one entry keyed by the weights/entry fingerprint, the graph, the input signature, the
options and the torch and memfit versions, holding

  artifacts.bin  the cache artifacts torch recorded while compiling this function on its first
                 call (``torch.compiler.save_cache_artifacts()``: AOTAutograd and FX graph cache
                 entries, autotuning results);
  kernels/       the C++ kernels inductor built for them (``.so`` / ``.o`` files, at their paths
                 relative to inductor's cache directory).

A start that finds the entry puts the kernels back into inductor's cache directory (where
missing) and hands the artifacts to ``torch.compiler.load_cache_artifacts()`` before its first
call: dynamo still traces the function, but AOTAutograd and inductor find their results instead of
lowering and generating code, and the C++ compiler finds its libraries built. The artifacts alone
hold C++ source only, so without the kernels a machine whose inductor cache directory is empty runs
g++ again on every start (the tests' tiny conv model: 14.8 s cold, 12.7 s from artifacts alone,
nearly all g++). A kernel's file name is a hash of its source and its compiler command line (ISA
flags included), so a kernel put back where another CPU or toolchain looks is never found, never
misused. MEMFIT_CACHE=require raises on a missing entry instead of compiling.

Each entry holds its own compile's artifacts and kernels only: recording runs under a fresh
artifact list (``CacheArtifactManager.with_fresh_cache``; the public save call returns everything
the process compiled so far) with inductor's cache directory pointed at an empty folder for the
compile. Inductor options are applied per compile (``torch.compile(options=)``), never by setting
``torch._inductor.config`` globally.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from memfit.compile.backends._common import graph_id, returning_plain_tensors, tensor_signature, uses_store, warm_up
from memfit.compile.backends.base import Availability, Backend, CompileRequest
from memfit.compile.backends.torch_settings import preserved_torch_settings
from memfit.errors import MemfitError

ARTIFACTS_FILE = "artifacts.bin"
KERNELS_DIR = "kernels"
_KERNEL_SUFFIXES = (".so", ".o")
# torch.compile modes that capture CUDA graphs ("max-autotune-no-cudagraphs" does not).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# Part of the key; bump it when what an entry holds changes, so older entries miss, not misread.
_ENTRY_FORMAT = "inductor-artifacts/2"


class InductorBackend(Backend):
    name = "inductor"
    float32_tolerance = 1e-4
    default_options: Mapping[str, Any] = {
        "mode": None,  # torch.compile mode: None, "reduce-overhead", "max-autotune", ...
        "dynamic": False,  # shapes are fixed per generation; False avoids symbolic-shape guards
        "fullgraph": False,
        "inductor_config": {},  # per-compile torch._inductor.config overrides
    }

    def available(self) -> Availability:
        # On CPU inductor compiles C++; without a compiler the first call fails deep in codegen.
        if sys.platform != "win32" and not (shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")):
            return Availability(
                False,
                "inductor needs a C++ compiler on CPU and none was found: install g++ or clang "
                "(e.g. apt-get install g++), or use backend='eager'.",
            )
        return Availability(True, "inductor is available")

    def compile(self, request: CompileRequest) -> Callable[..., Any]:
        import torch

        opts = self.resolve_options(request.options)
        self.require_available()
        fn, example_inputs = request.fn, request.example_inputs
        with preserved_torch_settings():
            # torch.compile refuses mode and options together; pass whichever was asked for.
            tuning = {"options": dict(opts["inductor_config"])} if opts["inductor_config"] else {"mode": opts["mode"]}
            compiled = torch.compile(
                fn, backend="inductor", dynamic=opts["dynamic"], fullgraph=opts["fullgraph"], **tuning
            )
            run = returning_plain_tensors(compiled, settings=preserved_torch_settings)
            # Artifacts are keyed by input signature, so only tensor inputs (what memfit.compile.entry_points
            # passes) go through the store; anything else compiles as before.
            tensors_only = all(isinstance(v, torch.Tensor) for v in example_inputs)
            if tensors_only and uses_store(request.cache, request.weights_fingerprint):
                signature = tensor_signature(self.name, example_inputs)
                key = _cache_key(request.weights_fingerprint, graph_id(fn), signature, opts)
                _first_call_through_store(run, example_inputs, request.cache, key)
            else:
                warm_up(run, example_inputs)
        return run


def _cache_key(weights_fingerprint: str, graph: str, signature: list[list[Any]], opts: Mapping[str, Any]) -> Any:
    from memfit.cache import compile_key

    return compile_key(
        weights_fingerprint=weights_fingerprint,
        graph=graph,
        input_signature=signature,
        backend="inductor",
        backend_options={"entry_format": _ENTRY_FORMAT, **opts},
    )


def _first_call_through_store(run: Callable[..., Any], example_inputs: Sequence[Any], cache: Any, key: Any) -> None:
    """The first (compiling) call, fed from the store's artifacts, or recorded into the store."""
    entry = cache.get(key)  # raises on a miss under MEMFIT_CACHE=require
    if entry is not None:
        _install_kernels(entry / KERNELS_DIR)
        _load_artifacts(entry)
        warm_up(run, example_inputs)
        return
    import torch
    from torch.compiler._cache import CacheArtifactManager

    with tempfile.TemporaryDirectory(prefix="memfit-inductor-") as scratch:
        with CacheArtifactManager.with_fresh_cache(), _inductor_cache_dir(scratch):
            warm_up(run, example_inputs)
            saved = torch.compiler.save_cache_artifacts()
        # None when inductor's caches are off (TORCHINDUCTOR_FX_GRAPH_CACHE=0 and the like): then
        # there is nothing to store, and the compile itself is fine.
        if saved is None:
            return
        artifacts, info = saved
        kernels = {f"{KERNELS_DIR}/{path.relative_to(scratch)}": path for path in Path(scratch).rglob("*")
                   if path.suffix in _KERNEL_SUFFIXES and path.is_file()}
        entry = cache.put(key, {ARTIFACTS_FILE: artifacts, **kernels},
                          meta={"artifacts": {k: len(v) for k, v in info.artifacts.items()}, "kernels": len(kernels)})
    if entry is not None:
        _install_kernels(entry / KERNELS_DIR)  # inductor's own cache dir gets them too, as after any compile


@contextlib.contextmanager
def _inductor_cache_dir(path: str):
    """Inductor's cache directory (read from TORCHINDUCTOR_CACHE_DIR on every use) set to ``path``
    while one component compiles, so every kernel it builds lands there to be stored."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _install_kernels(kernels: Path) -> None:
    """Put the stored kernels into inductor's cache directory where they are missing (each written
    under a temporary name and renamed, so a concurrent compile never sees half a library)."""
    if not kernels.is_dir():
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    for source in kernels.rglob("*"):
        if not source.is_file():
            continue
        target = root / source.relative_to(kernels)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        shutil.copy2(source, partial)
        os.replace(partial, target)


def _load_artifacts(entry: Path) -> None:
    import torch

    # The entry passed the store's checksums; None here means torch could not unpickle it.
    if torch.compiler.load_cache_artifacts((entry / ARTIFACTS_FILE).read_bytes()) is None:
        warnings.warn(
            f"torch could not load the inductor artifacts in {entry / ARTIFACTS_FILE}; this "
            "component is compiled from scratch. Clear them with `memfit cache clear --kind "
            "compiled` if this repeats.",
            stacklevel=4,
        )


def uses_cuda_graphs(options: Mapping[str, Any] | None) -> bool:
    """Whether inductor ``options`` (as InductorBackend takes them) make it capture CUDA graphs."""
    opts = InductorBackend.default_options | dict(options or {})
    config = dict(opts.get("inductor_config") or {})
    if config:  # torch.compile takes options instead of the mode then (see InductorBackend.compile)
        return bool(config.get("triton.cudagraphs", False))
    return opts.get("mode") in CUDA_GRAPH_MODES


def refuse_cuda_graphs(backend: Backend, options: Mapping[str, Any] | None, where: str) -> None:
    """Raise when ``backend`` would capture CUDA graphs of ``where``, an entry whose weights stream.

    A CUDA graph replays the memory addresses it captured, and streamed weights move to new ones on
    every forward, so a replay would read memory that belongs to something else by then.
    """
    if backend.name != InductorBackend.name:
        return
    if uses_cuda_graphs(dict(backend.default_options) | dict(options or {})):
        raise MemfitError(
            f"{where} streams its weights, which CUDA graphs cannot follow; compile it with inductor's default "
            "mode or mode='max-autotune-no-cudagraphs', or give a budget that keeps it resident."
        )
