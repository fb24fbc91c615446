"""What memfit asks of an execution device, behind one interface: streams, events, asynchronous
copies, pinned host memory and memory queries.

    runtime = runtime_for("cuda:0")     # CudaRuntime; "cpu" gives CpuRuntime, "mps"/"xpu" PlainRuntime
    runtime.device                      # where torch places the tensors it computes with

Everything memfit does on a GPU goes through a DeviceRuntime instead of calling ``torch.cuda``
directly, so the same code runs against the fake CUDA runtime of the tests
(memfit.testing.fake_cuda), which models a GPU on the CPU: copies that complete only when waited
for, device memory that is counted, pinned bytes that are counted. A missing wait then gives wrong
numbers in a CPU test instead of passing until it meets a real GPU.

Kinds of runtime:
  CpuRuntime    host RAM is the device: nothing is copied, streams do not exist.
  CudaRuntime   torch.cuda: side streams, events, copies from pinned (page-locked) memory.
  PlainRuntime  any other torch device (mps, xpu): staged generation with every weight resident;
                streaming needs streams and events memfit only drives on CUDA, so it is refused.
"""

from __future__ import annotations

import contextlib
import mmap
import platform
import sys
import warnings
from typing import Iterator

import torch

from memfit.errors import MemfitError
from memfit.sizes import format_bytes

__all__ = ["HOST_REGISTER_PORTABLE", "HOST_MEMORY_ALREADY_REGISTERED", "CpuRuntime", "CudaRuntime", "DeviceRuntime",
           "PinningWarning", "PlainRuntime", "cuda_device_count", "page_aligned_buffer", "pinned_fraction",
           "runtime_for", "use_cuda_runtime"]

#: cudaHostRegister's flag for pages that count as page-locked in every CUDA context, not only the one
#: current when they were registered (with ``--device cuda:1`` that would be GPU 0's, made for it).
HOST_REGISTER_PORTABLE = 1
#: cudaErrorHostMemoryAlreadyRegistered: a page of the range is page-locked already (by another library).
HOST_MEMORY_ALREADY_REGISTERED = 712


class PinningWarning(UserWarning):
    """memfit could not page-lock host memory for streaming: copies from it are pageable (synchronous, slower)."""


class DeviceRuntime:
    """The interface; CpuRuntime is the trivial implementation of every method."""

    #: The device as the user named it ("cuda:0"), for reports and messages.
    name: str = "cpu"
    #: Where torch places this runtime's tensors (a fake GPU's tensors live on the CPU).
    device: torch.device = torch.device("cpu")
    #: Weights must be copied into the device's own memory to run there (a GPU).
    separate_memory: bool = False
    #: memfit can stream weights to it (block by block, from host or disk).
    can_stream: bool = True

    # --- streams and events ----------------------------------------------------------------------

    def new_stream(self):
        return None

    def current_stream(self):
        return None

    @contextlib.contextmanager
    def use_stream(self, stream) -> Iterator[None]:
        """Work queued inside runs on ``stream``."""
        yield

    def new_event(self):
        return None

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in this device's memory already."""
        return tensor.device == self.device

    # --- copies and host memory ------------------------------------------------------------------

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A device copy of ``host`` (converted to ``dtype`` on the device), queued on the current stream.

        The copy is asynchronous where ``host`` is pinned: it is complete for work queued later on the
        same stream, and for other streams only once they wait for an event recorded after it.
        """
        return host if dtype is None else host.to(dtype)

    def copy_into(self, target: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``host`` into ``target`` (device memory of ``host``'s shape, converted to ``target``'s dtype on
        the device), queued on the current stream, asynchronous where ``to_device``'s copy is."""
        target.copy_(host)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (uint8, at least 1) of device memory that memfit lays tensors out in itself."""
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` (uint8) that the device copies from asynchronously (where it can
        be page-locked: a CUDA runtime that cannot says so with a PinningWarning and hands out pageable memory)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def release_arena(self, arena: torch.Tensor) -> None:
        """Give back what ``pinned_arena`` page-locked (the tensor itself is freed by its last reference)."""

    # --- memory ----------------------------------------------------------------------------------

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        raise MemfitError(f"memfit cannot measure the memory of {self.name}; pass an explicit budget.")

    def memory_in_use(self) -> int:
        """What the process holds on this device right now: the baseline a stage's plan adds to.

        On a device with its own memory that is what its allocator has handed out (allocated, not
        reserved: the blocks the caching allocator keeps free are reused by the stage's own tensors,
        and counted here they would be counted twice; between stages the runner empties that cache
        anyway). On the CPU the host is the device: the process's resident set.
        """
        if self.separate_memory:
            return self.memory_allocated()
        import psutil

        return psutil.Process().memory_info().rss

    def memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def max_memory_reserved(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        pass

    def alloc_retries(self) -> int:
        """How often the device's allocator had to free its cache and retry (a sign of running close to full)."""
        return 0

    def pinned_bytes(self) -> int:
        """Host bytes page-locked through this runtime right now."""
        return 0

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class CpuRuntime(DeviceRuntime):
    name = "cpu"
    device = torch.device("cpu")


class PlainRuntime(DeviceRuntime):
    """A torch device memfit places whole components on and cannot stream to (mps, xpu)."""

    separate_memory = True
    can_stream = False

    def __init__(self, device: torch.device):
        self.device = device
        self.name = str(device)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return host.to(self.device, dtype=dtype)

    def memory_allocated(self) -> int:
        return int(self._device_call("current_allocated_memory", "memory_allocated") or 0)

    def synchronize(self) -> None:
        self._device_call("synchronize")

    def empty_cache(self) -> None:
        self._device_call("empty_cache")

    def _device_call(self, *names: str):
        """Call the first of ``names`` that torch's module for this device type has (torch.mps, torch.xpu)."""
        module = getattr(torch, self.device.type, None)
        function = next((getattr(module, name) for name in names if hasattr(module, name)), None)
        return function() if function is not None else None


def pinned_fraction() -> float:
    """The share of the host's RAM memfit page-locks at most: Windows caps page-locked memory near half
    of RAM, and so does WSL (its GPU driver is Windows'); elsewhere some is left to the rest of the system."""
    windows = sys.platform == "win32" or "microsoft" in platform.uname().release.lower()
    return 0.45 if windows else 0.9


def page_aligned_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """A host buffer of exactly ``nbytes`` (uint8, at least 1) that starts on a page, and the length of the
    whole pages it spans, all inside memory of its own.

    The driver page-locks whole pages: a buffer that shared a page with another one registered apart
    would make the second registration fail (cudaErrorHostMemoryAlreadyRegistered), and unregistering
    one would unlock the other's page.
    """
    page = mmap.PAGESIZE
    nbytes = max(nbytes, 1)
    length = -(-nbytes // page) * page
    memory = torch.empty(length + page, dtype=torch.uint8)
    start = -memory.data_ptr() % page
    return memory[start:start + nbytes], length


class CudaRuntime(DeviceRuntime):
    separate_memory = True

    def __init__(self, device: torch.device):
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.name = str(self.device)
        self._registered: dict[int, int] = {}  # address -> bytes this runtime page-locked (one runtime per GPU)
        #: The most host memory this runtime page-locks at once; None: pinned_fraction() of the host's RAM.
        self.pinned_limit: int | None = None

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def use_stream(self, stream) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def new_event(self):
        return torch.cuda.Event()

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        # Copied in the file's dtype and converted on the GPU: the host never makes a converted copy.
        moved = host.to(self.device, non_blocking=True)
        return moved if dtype is None or dtype == moved.dtype else moved.to(dtype)

    def copy_into(self, target: torch.Tensor, host: torch.Tensor) -> None:
        if host.dtype == target.dtype:
            target.copy_(host, non_blocking=True)
        else:  # as to_device: copied in the file's dtype, converted on the GPU
            target.copy_(host.to(self.device, non_blocking=True))

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        # Registered rather than allocated pinned: torch's pinned allocator rounds every request up to
        # a power of two (a 9 GiB arena would take 16), page-locking an ordinary buffer takes its pages.
        arena, length = page_aligned_buffer(nbytes)
        failed = self._page_lock(arena.data_ptr(), length)
        if failed is not None:
            warnings.warn(
                f"memfit could not page-lock {format_bytes(length)} of host memory for streaming to {self.name} "
                f"({failed}); the weights in it are copied from pageable memory, which is slower. Give a smaller "
                "host budget (--budget with host=) or free host memory.", PinningWarning, stacklevel=2)
        return arena

    def _page_lock(self, address: int, length: int) -> str | None:
        """Register ``length`` bytes at ``address``; None when they are page-locked now, else why not."""
        limit = self.pinned_limit
        if limit is None:
            import psutil

            limit = int(psutil.virtual_memory().total * pinned_fraction())
        if self.pinned_bytes() + length > limit:
            return (f"{format_bytes(self.pinned_bytes())} is page-locked already and memfit locks at most "
                    f"{format_bytes(limit)}")
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):  # the registration is made from this GPU's own context
            code = int(cudart.cudaHostRegister(address, length, HOST_REGISTER_PORTABLE))
        if code == 0:
            self._registered[address] = length
            return None
        self._forget_error()
        if code == HOST_MEMORY_ALREADY_REGISTERED:
            return None  # locked by another library: copies are as fast, and unlocking it is not memfit's to do
        return f"CUDA error {code}"

    def _forget_error(self) -> None:
        # A failed runtime call stays the thread's last CUDA error, which torch's next check after a kernel
        # launch would raise as that kernel's failure: a launch here takes it, and the error is dropped.
        try:
            with torch.cuda.device(self.device):
                torch.zeros(1, device=self.device).add_(1)
        except RuntimeError:
            pass

    def release_arena(self, arena: torch.Tensor) -> None:
        # Only what this runtime registered (a deep copy of an optimized pipeline holds plain copies).
        if self._registered.pop(arena.data_ptr(), None) is not None:
            with torch.cuda.device(self.device):
                if int(torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())) != 0:
                    self._forget_error()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def pinned_bytes(self) -> int:
        return sum(self._registered.values())

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


# The runtime "cuda" devices get instead of CudaRuntime (the tests' fake GPU), or None.
_cuda_override = None
_cuda_runtimes: dict[torch.device, CudaRuntime] = {}


@contextlib.contextmanager
def use_cuda_runtime(make_runtime) -> Iterator[None]:
    """Inside, "cuda" devices run on ``make_runtime(torch.device)`` (memfit.testing.fake_cuda uses it)."""
    global _cuda_override
    previous, _cuda_override = _cuda_override, make_runtime
    try:
        yield
    finally:
        _cuda_override = previous


def cuda_device_count() -> int:
    """How many CUDA devices runs may name here (the fake runtime's, while one is in use)."""
    if _cuda_override is not None:
        return getattr(_cuda_override, "device_count", 1)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def runtime_for(device: str | torch.device | DeviceRuntime | None) -> DeviceRuntime:
    """The runtime of ``device`` (None: the CPU)."""
    if isinstance(device, DeviceRuntime):
        return device
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cpu":
        return CpuRuntime()
    if device.type == "cuda":
        if _cuda_override is not None:
            return _cuda_override(device)
        if not torch.cuda.is_available():
            raise MemfitError(f"Device {device} was requested but torch reports no CUDA device "
                              f"(torch {torch.__version__}); use device='cpu' or install a CUDA build of torch.")
        runtime = CudaRuntime(device)
        return _cuda_runtimes.setdefault(runtime.device, runtime)  # one per GPU: its pinned bytes add up
    return PlainRuntime(device)
