"""A fake CUDA runtime on the CPU, so memfit's GPU code runs in CPU tests and a missing wait fails them.

    with fake_cuda(lazy=True) as gpu:              # "cuda" devices now run on ``gpu``
        memfit.generate(..., device="cuda")
        gpu.max_memory_reserved(), gpu.pinned_bytes(), gpu.pageable_copy_bytes

What it models, after how a GPU behaves (memfit.devices.DeviceRuntime is the interface):
  * Tensors "on the device" are CPU tensors (torch computes with them); the model is in the
    bookkeeping around them.
  * ``to_device`` on a side stream returns a tensor filled with NaN (ints: -1) at once and copies
    into it later: on a worker thread (default), or only when something waits for it (``lazy``:
    a stream synchronized, an event synchronized, another stream waiting for an event or a stream).
    The copy reads its source when it runs, as a DMA engine does, so a pinned buffer reused too
    early gives wrong numbers too. Copies on the current (compute) stream run at once: work queued
    after them on that stream sees them.
  * Device memory: every tensor made by ``to_device`` is allocated until its storage is freed
    (``allocations`` counts them, with ``device_buffer``'s: the caching allocator's churn). memfit
    uses each on the stream that allocated it (the allocator reuses freed memory in that stream's
    order), so reserved memory is allocated memory here.
  * ``device_buffer`` is device memory memfit lays tensors out in itself; ``copy_into`` copies into it
    as ``to_device`` copies (NaN until the copy runs). A copy queued on a side stream into memory whose
    last contents the compute stream took (waited for) after the side stream last waited for the
    compute stream is counted in ``unordered_overwrites``: a GPU could overwrite weights a queued
    forward has yet to read.
  * ``host_waits`` counts the times memfit made the host wait for the device (an event or stream
    synchronized), which a GPU's host spends idle instead of queuing work.
  * Pinned memory: ``pinned_arena`` counts its bytes; copies from memory outside every arena are
    counted in ``pageable_copy_bytes`` (on a real GPU they are synchronous, slow, and staged). An
    arena given back (``release_arena``) while a queued copy has yet to read it is counted in
    ``released_while_read``: a GPU's copy engine would read pages no longer locked, or freed.
  * Activations computed by torch are not counted: only what memfit moves is.
  * The current stream is per thread (``use_stream``), as torch.cuda's is, so a reader thread can
    queue copies on a side stream while the main thread computes.
  * A side stream waiting for the compute stream sees its data (the CPU ran that work already) but
    does not tell the host that the compute stream got there: only a host-synchronized event or
    ``synchronize`` does, so "the host waited for the GPU" is always an explicit step in memfit.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.devices import DeviceRuntime, use_cuda_runtime

__all__ = ["FakeCudaRuntime", "FakeEvent", "FakeStream", "fake_cuda"]

DEFAULT_TOTAL = 80 << 30


class FakeStream:
    """A queue of deferred copies with a position: ``enqueued`` marks queued, ``completed`` marks run."""

    def __init__(self, runtime: "FakeCudaRuntime", compute: bool = False):
        self.runtime = runtime
        self.compute = compute
        self.enqueued = 0
        self.completed = 0
        self._ops: deque = deque()
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._running = threading.RLock()
        self.known_compute = 0  # (side streams) the compute stream position this stream waited for last
        self.copied: list[tuple[int, int, int]] = []  # (position, begin, end) of copy_into's copies not yet taken

    def mark(self) -> int:
        """A new position on this stream (a kernel boundary); returns it."""
        with self._cond:
            self.enqueued += 1
            if self.compute and not self.runtime.lazy:
                self.completed = self.enqueued  # an eager "GPU" keeps up with the host
            return self.enqueued

    def enqueue(self, op) -> None:
        if self.compute:
            op()  # torch runs the compute stream's work on the CPU right away, so its copies must too
            self.mark()
            return
        with self._cond:
            self._ops.append(op)
            self.enqueued += 1
            if not self.runtime.lazy:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work, daemon=True, name="fake-cuda-stream")
                    self._worker.start()
                self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._ops:
                    self._cond.wait()
                op = self._ops[0]
            op()
            with self._cond:
                self._ops.popleft()
                self.completed += 1
                self._cond.notify_all()

    def complete_to(self, position: int) -> None:
        """Block until the work queued up to ``position`` has run (lazy: run it here)."""
        if self.compute:
            with self._cond:
                self.completed = max(self.completed, position)
            return
        if self.runtime.lazy:
            with self._running:  # one thread at a time runs this stream's ops, in order
                while True:
                    with self._cond:
                        if self.completed >= position or not self._ops:
                            return
                        op = self._ops.popleft()
                    op()
                    with self._cond:
                        self.completed += 1
        with self._cond:
            while self.completed < position:
                self._cond.wait()

    def synchronize(self) -> None:
        self.runtime.host_waits += 1
        self.complete_to(self.enqueued)

    def wait_event(self, event: "FakeEvent") -> None:
        # Work queued on this stream later must see the event's work: for the compute stream it runs
        # on the CPU the moment it is queued, so the event's work must be complete now.
        if event.stream is None:
            return
        if self.compute:
            event.complete()
            self.runtime.taken(event)
        elif event.stream.compute:
            self.known_compute = max(self.known_compute, event.position)
        else:
            self.enqueue(event.complete)

    def wait_stream(self, other: "FakeStream") -> None:
        position = other.enqueued
        if self.compute:
            other.complete_to(position)
        elif not other.compute:
            self.enqueue(lambda: other.complete_to(position))
        else:
            self.known_compute = max(self.known_compute, position)
        # A side stream waiting for the compute stream: the compute work queued so far has run on
        # the CPU already, so the data is there; and a GPU's host does not learn that the compute
        # stream got this far from it, so nothing is marked complete.

    def query(self) -> bool:
        return self.completed >= self.enqueued


class FakeEvent:
    def __init__(self):
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else _active_runtime().current_stream()
        self.position = self.stream.mark() if self.stream.compute else self.stream.enqueued

    def query(self) -> bool:
        return self.stream is None or self.stream.completed >= self.position

    def synchronize(self) -> None:
        """The host waits for the event (counted in the runtime's host_waits)."""
        if self.stream is not None:
            self.stream.runtime.host_waits += 1
        self.complete()

    def complete(self) -> None:
        """Run the work up to the event (a stream waiting for it, in this model)."""
        if self.stream is not None:
            self.stream.complete_to(self.position)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream if stream is not None else _active_runtime().current_stream()).wait_event(self)


class _Allocation:
    __slots__ = ("storage", "nbytes")

    def __init__(self, tensor: torch.Tensor):
        self.storage = StorageWeakRef(tensor.untyped_storage())
        self.nbytes = tensor.untyped_storage().nbytes()


_current_runtime: list["FakeCudaRuntime"] = []


def _active_runtime() -> "FakeCudaRuntime":
    return _current_runtime[-1]


class FakeCudaRuntime(DeviceRuntime):
    """A CUDA device modelled on the CPU; see the module docstring."""

    separate_memory = True
    can_stream = True
    device_count = 1

    def __init__(self, *, lazy: bool = False, total_memory: int = DEFAULT_TOTAL):
        self.name = "cuda:0 (fake)"
        self.device = torch.device("cpu")
        self.lazy = lazy
        self.total_memory = total_memory
        self._compute = FakeStream(self, compute=True)
        self._local = threading.local()  # the current stream is per thread, as torch.cuda's is
        self._streams: list[FakeStream] = []
        self._lock = threading.Lock()
        self._allocations: list[_Allocation] = []
        self._arenas: dict[int, int] = {}  # data_ptr -> bytes
        self._peak = 0
        self.bytes_in_flight = 0
        self.max_bytes_in_flight = 0
        self.pageable_copy_bytes = 0
        self.released_while_read = 0
        self._reads: dict[int, int] = {}  # arena address -> copies from it queued and not yet run
        self.copies = 0
        self.allocations = 0
        self.host_waits = 0
        self.unordered_overwrites = 0
        self._taken: list[tuple[int, int, int]] = []  # (begin, end, compute position) of copy_into's copies taken

    # --- streams and events ----------------------------------------------------------------------

    def new_stream(self) -> FakeStream:
        stream = FakeStream(self)
        self._streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", self._compute)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    # --- copies and host memory ------------------------------------------------------------------

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or host.dtype
        target = torch.empty(host.shape, dtype=dtype)
        target.fill_(float("nan") if dtype.is_floating_point else -1)
        with self._lock:
            self._allocations.append(_Allocation(target))
            self.allocations += 1
        self._queue_copy(target, host, target.is_inference())
        self._update_peaks()
        return target

    def _queue_copy(self, target: torch.Tensor, host: torch.Tensor, inference: bool) -> None:
        nbytes = host.numel() * host.element_size()
        with self._lock:
            self.copies += 1
            arena = self._arena_of(host)
            if arena is None:
                self.pageable_copy_bytes += nbytes
            else:
                self._reads[arena] = self._reads.get(arena, 0) + 1
            self.bytes_in_flight += nbytes
            self.max_bytes_in_flight = max(self.max_bytes_in_flight, self.bytes_in_flight)

        def copy() -> None:
            # It may run after the inference_mode block that queued it has ended, as a GPU's would.
            with torch.inference_mode(inference):
                target.copy_(host)
            with self._lock:
                self.bytes_in_flight -= nbytes
                if arena in self._reads:  # not when given back meanwhile (counted then)
                    self._reads[arena] -= 1

        self.current_stream().enqueue(copy)

    def copy_into(self, target: torch.Tensor, host: torch.Tensor) -> None:
        stream = self.current_stream()
        begin = target.data_ptr()
        end = begin + target.numel() * target.element_size()
        with self._lock:
            if not stream.compute and any(b < end and begin < e and stream.known_compute < position
                                          for b, e, position in self._taken):
                self.unordered_overwrites += 1
            self._taken = [(b, e, position) for b, e, position in self._taken if not (b < end and begin < e)]
        # A view made in inference mode is written in it (torch refuses otherwise), wherever the copy runs.
        inference = target.is_inference() or torch.is_inference_mode_enabled()
        with torch.inference_mode(inference):
            target.fill_(float("nan") if target.dtype.is_floating_point else -1)
        self._queue_copy(target, host, inference)
        if stream.compute:  # taken at once by the work queued after it
            with self._lock:
                self._taken.append((begin, end, stream.mark()))
        else:
            stream.copied.append((stream.enqueued, begin, end))

    def taken(self, event: FakeEvent) -> None:
        """The compute stream waited for ``event``: the copy_into copies before it on its stream are taken."""
        stream = event.stream
        done = [entry for entry in stream.copied if entry[0] <= event.position]
        if not done:
            return
        stream.copied = [entry for entry in stream.copied if entry[0] > event.position]
        position = self._compute.mark()
        with self._lock:
            self._taken += [(begin, end, position) for _, begin, end in done]

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        with self._lock:
            self._allocations.append(_Allocation(buffer))
            self.allocations += 1
        self._update_peaks()
        return buffer

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        arena = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        with self._lock:
            self._arenas[arena.data_ptr()] = arena.numel()
        return arena

    def release_arena(self, arena: torch.Tensor) -> None:
        with self._lock:
            if self._arenas.pop(arena.data_ptr(), None) is not None and self._reads.pop(arena.data_ptr(), 0):
                self.released_while_read += 1

    def _arena_of(self, tensor: torch.Tensor) -> int | None:
        """The address of the pinned arena ``tensor`` lies in, or None (pageable memory)."""
        begin = tensor.data_ptr()
        end = begin + tensor.numel() * tensor.element_size()
        return next((start for start, size in self._arenas.items() if start <= begin and end <= start + size), None)

    # --- memory ----------------------------------------------------------------------------------

    def _allocation_of(self, tensor: torch.Tensor) -> _Allocation | None:
        ref = StorageWeakRef(tensor.untyped_storage())
        with self._lock:
            return next((a for a in self._allocations if a.storage.cdata == ref.cdata and not a.storage.expired()),
                        None)

    def _allocated(self) -> int:
        with self._lock:
            self._allocations = [a for a in self._allocations if not a.storage.expired()]
            return sum(a.nbytes for a in self._allocations)

    def _update_peaks(self) -> None:
        self._peak = max(self._peak, self._allocated())

    def mem_get_info(self) -> tuple[int, int]:
        return max(0, self.total_memory - self.memory_reserved()), self.total_memory

    # Reserved memory is allocated memory here (see the module docstring): the two figures are one.
    def memory_allocated(self) -> int:
        self._update_peaks()
        return self._allocated()

    memory_reserved = memory_allocated

    def max_memory_allocated(self) -> int:
        self._update_peaks()
        return self._peak

    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self) -> None:
        self._peak = self._allocated()
        self.max_bytes_in_flight = self.bytes_in_flight

    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self._arenas.values())

    def pinned_arenas(self) -> list[int]:
        """The size of every pinned arena held now, in the order they were made."""
        with self._lock:
            return list(self._arenas.values())

    def owns(self, tensor: torch.Tensor) -> bool:
        return self._allocation_of(tensor) is not None

    def synchronize(self) -> None:
        self.host_waits += 1
        for stream in [*self._streams, self._compute]:
            stream.complete_to(stream.enqueued)

    def empty_cache(self) -> None:
        self._update_peaks()


@contextlib.contextmanager
def fake_cuda(*, lazy: bool = False, total_memory: int = DEFAULT_TOTAL) -> Iterator[FakeCudaRuntime]:
    """Inside, every "cuda" device memfit is given runs on one FakeCudaRuntime, which this yields."""
    runtime = FakeCudaRuntime(lazy=lazy, total_memory=total_memory)
    _current_runtime.append(runtime)
    try:
        with use_cuda_runtime(lambda device: runtime):
            yield runtime
    finally:
        _current_runtime.remove(runtime)
