"""A compiled component's torch weights, kept out of memory while its compiled model serves it.

A backend whose compiled model holds its own copy of the weights (OpenVINO, ONNX Runtime:
``Backend.holds_own_weights``) leaves the torch module's parameters unused: every call goes to the
compiled model. Kept as loaded they would double the component's memory. So each parameter is
re-pointed to a private memory map of the component's own safetensors file (``FileWeights``):

* where the file holds it in the parameter's dtype, the map *is* the weight: nothing is read into
  the process until something reads it, and what is read stays reclaimable page cache;
* where it does not (a bf16 run of fp32 files), the parameter becomes the map in the file's dtype,
  and ``held()`` converts it back for as long as an eager call or a compile needs it. Anything
  else that reads it meanwhile gets the file's dtype: a dtype error, never wrong numbers.

The first parameter keeps its loaded form (converted, if it was): ``module.dtype`` and
``module.device``, which pipelines read to place their inputs, come from it.

A module loaded in its files' dtype to skip converting it at load (memfit.run.runner: the compiled
model, not the torch weights, serves it) is given the dtype it runs in: its first parameter and its
floating buffers are converted to it, ``held()`` and ``restore()`` convert to it, and where its
weights cannot be released the whole module is converted, so it runs as if loaded in that dtype.

What is never released: a module with a weight that no file of its folder holds with the same
values (a LoRA's own tensors, a fused or changed weight, a module built in memory): ``release``
then keeps every weight and ``kept_because`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
from pathlib import Path
from typing import Callable, Iterator

import torch

from memfit.safetensors_header import TORCH_DTYPES, read_header, same_samples

__all__ = ["FileWeights", "source_folder"]

# How much of the files a conversion reads before it lets their pages go again (see FileWeights._bring_in).
_DROP_EVERY_BYTES = 256 << 20



def source_folder(module: torch.nn.Module, given: str | Path | None = None) -> Path | None:
    """The folder of ``module``'s safetensors files: ``given``, else the one its config names."""
    candidates = [Path(given)] if given is not None else []
    named = getattr(getattr(module, "config", None), "_name_or_path", None) or getattr(module, "name_or_path", None)
    if named:
        candidates.append(Path(named))
    for folder in candidates:
        if folder.is_dir() and any(folder.glob("*.safetensors")):
            return folder
    return None


class FileWeights:
    """The parameters of one module, released to (and brought back from) its safetensors files."""

    def __init__(self, module: torch.nn.Module, folder: str | Path | None, dtype: torch.dtype | None = None,
                 key_prefix: str = ""):
        self.module = module
        self.key_prefix = key_prefix  # a block of a component: its path in the component's files ("up_blocks.1.")
        self.dtype = dtype  # the dtype the module runs in, where it was loaded in another (None: as loaded)
        self.folder = source_folder(module, folder)
        self.kept_because = "" if self.folder is not None else "no safetensors file of its own to map them from"
        self.released = False
        self._loaded: dict[int, tuple[torch.nn.Parameter, torch.Tensor, torch.dtype]] = {}  # id -> (param, map view, dtype)
        self._maps: list[mmap.mmap] = []
        self._depth = 0
        self._brought_in = False  # inside held(): the parameters are as the module runs them

    @property
    def released_bytes(self) -> int:
        """Bytes of the weights, in the dtype the module runs in, that are no longer in memory."""
        return sum(view.numel() * torch.empty((), dtype=dtype).element_size() for _, view, dtype in self._loaded.values())

    def release(self) -> bool:
        """Point every parameter (but the first) at the file; False (and ``kept_because``) if not possible."""
        if self.released:
            return True
        if not self.kept_because and not self._loaded:
            self._map_parameters()
        if self.kept_because:
            if self.dtype is not None:
                self.module.to(self.dtype)  # kept in memory: in the dtype it runs in
            return False
        if self._depth == 0:
            self._point_at_files()
        else:
            self._brought_in = True  # inside held(): as loaded until it ends
        self.released = True
        return True

    def drop(self) -> None:
        """Inside ``held()``: the caller no longer needs the weights (a compile has built its model)."""
        if self.released and self._brought_in:
            self._point_at_files()

    @contextlib.contextmanager
    def held(self, until_needed: bool = False) -> Iterator[Callable[[], None]]:
        """The parameters as the module runs them, for the duration (eager calls, compiles).

        With ``until_needed`` they stay as they are until the caller calls what this yields: a compile
        does so only when it builds, so one that finds its model stored converts nothing.
        """
        self._depth += 1
        try:
            if not until_needed:
                self._bring_in()
            yield self._bring_in
        finally:
            self._depth -= 1
            if self._depth == 0 and self.released and self._brought_in:
                self._point_at_files()

    def _bring_in(self) -> None:
        if not self.released or self._brought_in:
            return
        read = 0
        for param, view, dtype in self._loaded.values():
            if view.dtype != dtype:
                param.data = view.to(dtype)
                read += view.nbytes
                if read >= _DROP_EVERY_BYTES:
                    # Converted: the file's pages are not needed in this process. Dropped as it goes, else every
                    # page of the files would be resident beside the converted copy until the end.
                    self._drop_pages()
                    read = 0
        self._drop_pages()
        self._brought_in = True

    def restore(self) -> None:
        """The weights back in memory in the module's dtype (for good: uncompile, an eager fallback)."""
        if not self.released:
            return
        for param, view, dtype in self._loaded.values():
            param.data = view.to(dtype, copy=True)
        self.released = False
        self._loaded.clear()
        self._maps.clear()  # the views that kept them open are gone

    # --- internals -------------------------------------------------------------------------------

    def _map_parameters(self) -> None:
        """Find every parameter in the files, checked against the loaded values (samples)."""
        files = self._open_files()
        prefix = getattr(self.module, "base_model_prefix", "") or ""
        named = list(self.module.named_parameters())
        first = named[0][1] if named else None
        found: dict[int, tuple[torch.nn.Parameter, torch.Tensor, torch.dtype]] = {}
        for name, param in named:
            if param is first:
                continue
            shown = self.key_prefix + name
            if param.device.type != "cpu":
                self.kept_because = f"{shown} is on {param.device}, not in host memory"
                return
            keys = (self.key_prefix + name,) if self.key_prefix else (name, f"{prefix}.{name}", name.removeprefix(prefix + "."))
            view = next((files[key] for key in keys if key in files), None)
            if view is None:
                self.kept_because = f"{shown} is in no safetensors file of {self.folder} (a LoRA or a changed module)"
                return
            if tuple(view.shape) != tuple(param.shape) or not same_samples(view, param.data):
                self.kept_because = f"{shown} differs from the file in {self.folder} (changed after loading)"
                return
            found[id(param)] = (param, view, self._run_dtype(param))
        self._loaded = found
        # The first parameter and the buffers can be views of the loader's whole-file map (a file in the dtype the
        # module runs in), which would keep every page read from it (the samples above: SDXL's UNet, 0.11 GiB)
        # resident in this process; own copies are small.
        if first is not None:
            first.data = first.data.to(self._run_dtype(first), copy=True)
        for buffer in self.module.buffers():
            buffer.data = buffer.data.to(self._run_dtype(buffer), copy=True)
        self._drop_pages()

    def _run_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype

    def _open_files(self) -> dict[str, torch.Tensor]:
        views: dict[str, torch.Tensor] = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            header = read_header(path)
            with path.open("rb") as handle:
                # Private: torch wants a writable buffer; nothing writes to it, and the file never changes.
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps.append(mapping)
            for key, entry in header.entries.items():
                dtype = TORCH_DTYPES.get(entry["dtype"])
                begin, end = entry["data_offsets"]
                if dtype is None or end == begin:
                    continue
                count = (end - begin) // torch.empty((), dtype=dtype).element_size()
                flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=header.data_start + begin)
                views[key] = flat.view(entry["shape"])
        return views

    def _point_at_files(self) -> None:
        for param, view, _ in self._loaded.values():
            param.data = view
        self._brought_in = False
        gc.collect()  # a compile's graphs hold the converted weights in reference cycles
        _trim_heap()
        self._drop_pages()

    def _drop_pages(self) -> None:
        """Let the pages read from the maps go from this process (they stay in the page cache)."""
        for mapping in self._maps:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                mapping.madvise(mmap.MADV_DONTNEED)


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS: weights converted at load time are many mid-sized
    allocations, which glibc otherwise keeps in its arenas after they are freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
