"""Measuring peak memory of a stretch of work: peak RSS on the CPU; on a GPU peak allocated and reserved
device memory (loading and running apart), pinned host bytes and peak RSS.

Peak RSS comes from the kernel's high-water mark (VmHWM), reset at the start of each stretch by
writing "5" to /proc/self/clear_refs. Where that file is not writable (non-Linux, some sandboxes)
a background thread samples RSS every few milliseconds instead, which can miss a short spike;
`PeakMemory.method` says which one was used so reports never overstate their precision.

That mark is also what getrusage's ru_maxrss and `time -v` report for the whole process, so after a
run they show only the peak since its last stage began; process_peak_rss folds in what every reset
discarded and is the process's peak since it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from memfit.safetensors_header import close_unused_mappings

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def current_rss() -> int:
    return psutil.Process().memory_info().rss


class _MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> _MallocInfo | None:
    """glibc's allocator figures now (mallinfo2); None where it is not there."""
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallocInfo
    return info()


def _heap_free_bytes() -> int:
    """The bytes of free chunks glibc's heaps hold (0 where glibc's mallinfo2 is not there)."""
    info = _mallinfo()
    return 0 if info is None else int(info.fordblks)


_heap_holes = 0  # the most free heap a stretch under heap_for_temporaries_under left behind


def heap_holes() -> int:
    """The free chunks work under heap_for_temporaries_under left in the heap, at most (bytes).

    After release_freed_memory their pages are back with the OS, but the allocator serves later requests of
    any size from free chunks before it maps fresh memory (the mmap threshold only applies where none fits),
    and a chunk freed again stays resident until the next trim: a later stage may grow by up to this much
    over its own tensors, so its plan counts it with what the process already holds."""
    return _heap_holes


def read_peak_rss() -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_peak_before_resets = 0  # the highest high-water mark any reset_peak_rss discarded


def reset_peak_rss() -> bool:
    global _peak_before_resets
    before = read_peak_rss()
    if before is None:
        return False
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    _peak_before_resets = max(_peak_before_resets, before)
    return True


def process_peak_rss() -> int:
    """The peak RSS of this process since it started, in bytes, whatever memfit measured in between.

    memfit resets the kernel's high-water mark at every stage (reset_peak_rss), and with it what
    ru_maxrss (``resource.getrusage``, ``/usr/bin/time -v``) reports: read after a run, those give
    the peak of its last stage only. This is what they would have said.
    """
    return max(read_peak_rss() or _rusage_peak_rss() or current_rss(), _peak_before_resets)


def _rusage_peak_rss() -> int | None:
    """ru_maxrss where there is no /proc (macOS counts it in bytes, other systems in KiB); None on Windows."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS.

    glibc keeps freed heap memory in its arenas; without malloc_trim a stage's weights, though
    freed, would still count in the RSS of the next stage and stages would look like they overlap.
    The same goes for the pages of a weights file's mapping that no tensor shows any more (a stage's
    component loaded as views of its file): the mapping is closed.
    """
    gc.collect()
    close_unused_mappings()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def collects_only_its_own_garbage(run):
    """Decorator: while ``run`` runs, the objects alive before it are frozen out of garbage collection.

    release_freed_memory collects after every stage so a stage's freed weights leave RSS before the
    next stage loads. A full collection walks every object alive, and once torch, diffusers,
    transformers and a backend are imported that is about half a million: 0.24-0.36 s per
    collection, measured, six per generation. Frozen (gc.freeze), they are skipped and a
    collection walks only what the run created, its stage pipelines among them. They are unfrozen
    afterwards, so the process's garbage collection is as it was; where the caller froze objects
    itself, its choice is left alone and nothing is frozen.
    """

    @functools.wraps(run)
    def wrapper(*args, **kwargs):
        global _froze_for_run
        if gc.get_freeze_count():
            return run(*args, **kwargs)
        gc.freeze()
        _froze_for_run = True
        try:
            return run(*args, **kwargs)
        finally:
            _froze_for_run = False
            gc.unfreeze()

    return wrapper


_froze_for_run = False  # whether collects_only_its_own_garbage froze the objects alive when the run began


def freeze_the_run_set_up() -> None:
    """Inside collects_only_its_own_garbage, also freeze what the run created before its first stage.

    Opening a model imports its pipeline's modules (diffusers and transformers import lazily):
    another 130 thousand objects, which every collection after a stage would walk again, 0.07-0.1 s
    each. Nothing of a stage is alive yet, so no stage's weights are frozen with them.
    """
    if _froze_for_run:
        gc.freeze()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc mallopt parameters
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # where glibc's own (dynamic) mmap threshold stops rising
_GLIBC_MMAPS_MAX = 65536  # glibc's default count of blocks it may serve with mmap
_INT_MAX = 2**31 - 1  # mallopt takes a C int
HEAP_MMAP_THRESHOLD = 1 << 20
_fixed_threshold: int | None = None  # the mmap threshold memfit set, if it set one


def return_large_frees_to_os() -> bool:
    """Serve allocations of 1 MiB and more with mmap, so freeing them returns them to the OS at once.

    glibc starts at 128 KiB but raises its mmap threshold to the size of each mmapped block freed,
    up to 32 MiB; after that, freed activation buffers of up to 32 MiB stay in the heap, and RSS
    ratchets up pass after pass (measured: a 512x512 VAE decode's RSS grew by 0.8 GiB over the
    live tensors). A fixed threshold turns that off. memfit sets it when it runs under a budget;
    it is process-wide and only changes where glibc puts large blocks, never what a program
    computes. Returns False where glibc is not the allocator.
    """
    return _set_mmap_threshold(HEAP_MMAP_THRESHOLD)


@contextlib.contextmanager
def heap_for_temporaries_under(nbytes: int):
    """While inside, allocations under ``nbytes`` come from the heap again (where memfit fixed the
    threshold lower; otherwise nothing changes).

    For work that allocates and frees many same-sized temporaries in a row (the banded decode's
    bands): at 1 MiB each would be a fresh mapping whose pages the kernel faults in and zeroes.
    Measured, SD 1.5 fp32 512x512 banded decode: 19.8 s at 1 MiB, 13.3 s at 16 MiB. Only here:
    raised for a whole run, the same setting left SDXL's bf16 decode 30-40% above its planned peak.
    The heap the temporaries leave behind is trimmed at the end of the stage (release_freed_memory).
    Where it did change the threshold, on leaving it records the free heap bytes the stretch inside added
    (glibc's free chunks after it less those before it, mallinfo2's fordblks; 0 without mallinfo2): heap_holes()
    returns the largest such figure of any stretch so far, which later stages' plans count.
    """
    global _heap_holes
    previous = _fixed_threshold
    if previous is None or previous >= nbytes or not _set_mmap_threshold(nbytes):
        yield
        return
    free_before = _heap_free_bytes()
    try:
        yield
    finally:
        _set_mmap_threshold(previous)
        _heap_holes = max(_heap_holes, _heap_free_bytes() - free_before)


def mmap_threshold_fixed() -> bool:
    """Whether memfit fixed glibc's mmap threshold in this process (return_large_frees_to_os: a run under a
    budget, or one that lets weights go)."""
    return _fixed_threshold is not None


@contextlib.contextmanager
def every_temporary_from_heap():
    """While inside, allocations of every size come from the heap, and freed ones stay there for the next
    allocation; only where memfit fixed no mmap threshold (mmap_threshold_fixed), otherwise nothing changes.

    For the plain fp32 VAE decode on the CPU, whose temporaries are mostly over glibc's 32 MiB ceiling (SD 1.5 at
    512x512: 64-256 MiB each): glibc serves each with a fresh mapping whose pages the kernel faults in and
    zeroes, 3 million page faults per decode. Measured, SD 1.5 fp32 VAE at 512x512 on 2 threads, fresh
    processes: 12.1-12.5 s against 15.4-17.3 s, 0.1-0.4 million faults; the heap then holds freed blocks
    beside the live ones (the stage's peak 2.5-2.8 GiB against 1.7 GiB), which the plan counts
    (memfit.plan.activations.decode_heap_slack). On leaving, glibc maps large blocks again, with its
    thresholds where its own rise takes them (blocks over 32 MiB mapped, the heap's top trimmed over 64 MiB),
    and the stage's end trims the heap (release_freed_memory). Nothing is recorded for heap_holes(): such a
    stretch runs only where the budget holds every weight with room for the heap's holes on top of the stage.
    """
    if _fixed_threshold is not None or not _mallopt(_M_MMAP_MAX, 0):
        yield
        return
    _mallopt(_M_TRIM_THRESHOLD, _INT_MAX)  # a freed block at the heap's top stays for the next one
    try:
        yield
    finally:
        _mallopt(_M_MMAP_MAX, _GLIBC_MMAPS_MAX)
        _mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_THRESHOLD_MAX)
        _mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)


def _mallopt(parameter: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(parameter, value))
    except (OSError, AttributeError):
        return False


def _set_mmap_threshold(nbytes: int) -> bool:
    global _fixed_threshold
    done = _mallopt(_M_MMAP_THRESHOLD, nbytes)
    if done:
        _fixed_threshold = nbytes
    return done


@dataclass
class DevicePeaks:
    """What a stretch of work peaked at on a device with memory of its own (a GPU), in bytes.

    Loading and running are measured apart (``PeakMemory.loaded`` resets the device's peaks between
    them): a load's transient copies would otherwise hide what the run itself needs.
    """

    peak_allocated: int = 0  # the allocator's peak of live tensors while running
    peak_reserved: int = 0  # ... and of what it held from the driver (live tensors, cached blocks)
    load_peak_allocated: int = 0  # the same two while loading and fitting (0 when nothing loaded)
    load_peak_reserved: int = 0
    pinned_bytes: int = 0  # the most host memory page-locked for streaming at once (seen at loads and the end)
    peak_rss: int = 0  # host memory of the process, loading included
    alloc_retries: int = 0  # times the allocator had to free its cache and retry: running close to full

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class PeakMemory:
    """Context manager: `with PeakMemory(device) as peak: ...` then read `peak.peak_bytes`.

    ``device``: "cpu", a torch device or a memfit.devices.DeviceRuntime. On a device with memory of
    its own (a GPU) the peak is its allocator's peak allocated memory, and ``device_peaks`` holds
    allocated and reserved peaks for loading and running apart, pinned host bytes and peak RSS;
    on the CPU, peak RSS (``device_peaks`` stays None).
    """

    device: object = "cpu"
    start_bytes: int = 0
    peak_bytes: int = 0
    method: str = ""
    device_peaks: DevicePeaks | None = None

    def __enter__(self) -> "PeakMemory":
        from memfit.devices import runtime_for

        self.runtime = runtime_for(self.device)
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        if self.runtime.separate_memory:
            self.runtime.synchronize()
            self.runtime.reset_peak_memory_stats()
            self.device_peaks = DevicePeaks()
            self._retries = self.runtime.alloc_retries()
            self.start_bytes = self.runtime.memory_allocated()
            self.method = "device max_memory_allocated"
        self._rss_method = self._start_rss()
        if not self.runtime.separate_memory:
            self.start_bytes = current_rss()
            self.method = self._rss_method
        return self

    def loaded(self) -> None:
        """Loading is done: keep the device's peaks so far as the load's, and measure the run from here."""
        peaks = self.device_peaks
        if peaks is None:
            return
        self.runtime.synchronize()
        peaks.load_peak_allocated = max(peaks.load_peak_allocated, self.runtime.max_memory_allocated())
        peaks.load_peak_reserved = max(peaks.load_peak_reserved, self.runtime.max_memory_reserved())
        peaks.pinned_bytes = max(peaks.pinned_bytes, self.runtime.pinned_bytes())
        self.runtime.reset_peak_memory_stats()

    def _start_rss(self) -> str:
        if reset_peak_rss():
            return "VmHWM"
        self._sampled_peak = current_rss()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return "sampled RSS"

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled_peak = max(self._sampled_peak, current_rss())
            time.sleep(0.002)

    def _peak_rss(self) -> int:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            return max(self._sampled_peak, current_rss())
        return read_peak_rss() or current_rss()

    def __exit__(self, *exc_info) -> None:
        peaks = self.device_peaks
        if peaks is not None:
            self.runtime.synchronize()
            peaks.peak_allocated = self.runtime.max_memory_allocated()
            peaks.peak_reserved = self.runtime.max_memory_reserved()
            peaks.pinned_bytes = max(peaks.pinned_bytes, self.runtime.pinned_bytes())
            peaks.alloc_retries = self.runtime.alloc_retries() - self._retries
            peaks.peak_rss = self._peak_rss()
            self.peak_bytes = max(peaks.peak_allocated, peaks.load_peak_allocated)
            return
        self.peak_bytes = self._peak_rss()
