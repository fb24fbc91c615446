"""Hook mechanics for the executor: one registry of named hooks per module, real-storage swapping.

Nothing here knows about pipelines or plans (executor.py does); a hook only knows the tensors it
swaps and the runtime it prefetches through.

Lifecycle (after diffusers' hooks/hooks.py, with one system instead of two):
  * ``HookRegistry.of(module)`` returns the module's registry, creating it on first use. The
    registry installs exactly one torch forward pre-hook and one forward hook (``always_call``, so
    weights are swapped back even when the forward raises) that dispatch to its named hooks in
    registration order (pre) and reverse order (post).
  * ``registry.register(hook)`` calls ``hook.initialize(module)``; ``registry.remove(name)`` calls
    ``hook.deinitialize(module)``. Removing the last hook removes the torch hooks and the
    ``_memfit_hooks`` attribute, so a restored module carries nothing of memfit.
  * Only the torch hook *ids* are kept (not RemovableHandles: their weak reference would survive a
    ``copy.deepcopy`` pointing at the original module, and removing hooks from a copy would strip
    the original).

Compilation: the dispatch is wrapped in ``torch.compiler.disable``, so a compiled component breaks
its graph exactly at each hooked module's entry and exit and traces everything between.

Why swapping ``param.data`` between real storages and never parking on ``meta``: any code that
reads a weight outside a forward (``.item()``, a dtype check, a cache sized from a weight) must see
real data. A parameter object is never replaced, so optimizers, tied
weights and user references keep pointing at the live parameter.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from memfit.devices import DeviceRuntime
from memfit.errors import MemfitError
from memfit.text_enum import TextEnum
from memfit.run.timeline import record_move
from memfit.safetensors_header import SAMPLE_COUNT, MappedFile, sample_starts

__all__ = ["ALIGNMENT", "BlockSlots", "HookRegistry", "MappedSafetensors", "ModuleHook", "MappedPages", "Modes", "PhaseSwitch",
           "Phases", "Prefetches", "ReadAhead", "ResidentHook", "Runtime", "Shared", "Slot", "SlotKind", "StagingRing", "SwapHook",
           "aligned", "inference_mode_for", "mapped_view", "weights_ready"]

REGISTRY_ATTR = "_memfit_hooks"
READER_THREAD = "memfit-prefetch"  # the name prefix of the threads that read blocks ahead
#: Offsets inside a pinned arena are multiples of this (the device allocator's own granularity), so
#: every tensor view is aligned for its dtype and for the copy engine.
ALIGNMENT = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class ModuleHook:
    """A named hook; subclasses override what they need. ``name`` is unique per module."""

    name = "memfit.hook"

    def initialize(self, module: torch.nn.Module) -> None:
        pass

    def deinitialize(self, module: torch.nn.Module) -> None:
        pass

    def pre_forward(self, module: torch.nn.Module) -> None:
        pass

    def post_forward(self, module: torch.nn.Module) -> None:
        pass


class HookRegistry:
    """The named, ordered, removable hooks of one module (stored as ``module._memfit_hooks``)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.hooks: dict[str, ModuleHook] = {}
        self._pre_id: int | None = None
        self._post_id: int | None = None

    @classmethod
    def of(cls, module: torch.nn.Module) -> "HookRegistry":
        registry = module.__dict__.get(REGISTRY_ATTR)
        if registry is None:
            registry = cls(module)
            # object.__setattr__: nn.Module.__setattr__ would be fine too, but this keeps the
            # registry out of any module-specific __setattr__ logic.
            object.__setattr__(module, REGISTRY_ATTR, registry)
        return registry

    @staticmethod
    def get(module: torch.nn.Module) -> "HookRegistry | None":
        return module.__dict__.get(REGISTRY_ATTR)

    def register(self, hook: ModuleHook) -> None:
        if hook.name in self.hooks:
            raise MemfitError(
                f"{type(self.module).__name__} already has a memfit hook named {hook.name!r}; "
                "call memfit.restore(pipe) before optimizing it again."
            )
        hook.initialize(self.module)
        self.hooks[hook.name] = hook
        if self._pre_id is None:
            self._pre_id = self.module.register_forward_pre_hook(self._pre, with_kwargs=True).id
            self._post_id = self.module.register_forward_hook(self._post, always_call=True).id

    def remove(self, name: str) -> None:
        hook = self.hooks.pop(name, None)
        if hook is None:
            return
        hook.deinitialize(self.module)
        if not self.hooks:
            self.module._forward_pre_hooks.pop(self._pre_id, None)
            self.module._forward_pre_hooks_with_kwargs.pop(self._pre_id, None)
            self.module._forward_hooks.pop(self._post_id, None)
            self.module._forward_hooks_always_called.pop(self._post_id, None)
            self._pre_id = self._post_id = None
            self.module.__dict__.pop(REGISTRY_ATTR, None)

    # Hook dispatch swaps tensors, waits on events and starts threads: nothing a compiled graph can
    # hold. Disabled for the compiler, each call is one clean boundary instead of a trace that
    # breaks somewhere inside (and again on every streamed block).
    @torch.compiler.disable
    def _pre(self, module, args, kwargs):
        for hook in self.hooks.values():
            hook.pre_forward(module)
        return None  # inputs unchanged

    @torch.compiler.disable
    def _post(self, module, args, output):
        for hook in reversed(list(self.hooks.values())):
            hook.post_forward(module)
        return None  # output unchanged


@contextlib.contextmanager
def weights_ready(*modules: torch.nn.Module) -> Iterator[None]:
    """Run the memfit hooks of ``modules`` around code that uses their weights without calling them
    (a fused, banded computation): their tensors are in run form inside, back home after."""
    entered = []
    try:
        for module in modules:
            registry = HookRegistry.get(module)
            if registry is not None:
                registry._pre(module, (), {})
                entered.append((registry, module))
        yield
    finally:
        for registry, module in reversed(entered):
            registry._post(module, (), None)


# --- shared, read-only storage --------------------------------------------------------------------


class Shared:
    """A read-only tensor that copies of a pipeline share instead of cloning.

    ``copy.deepcopy(pipe)`` would otherwise clone every memory-mapped weight into RAM (and fail on
    the mmap object itself). The file behind it never changes while memfit runs, so sharing is safe.
    ``pages`` (for a mapped view) lets the hooks hint the kernel about its pages; ``origin`` says which
    bytes of which file it is (path, byte range, the view's shape, stride and offset), for what holds a
    copy of it to know what it holds.
    """

    __slots__ = ("tensor", "pages", "origin")

    def __init__(self, tensor: torch.Tensor, pages: "MappedPages | None" = None, origin: tuple | None = None):
        self.tensor = tensor
        self.pages = pages
        self.origin = origin

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


class MappedPages:
    """The page range of one mapped tensor.

    release(): drop the pages from this process's mapping (MADV_DONTNEED). They stay in the page
    cache, which the kernel may reclaim, but no longer count in the process's RSS, so a streamed
    block costs its bytes only while it runs and memory figures follow the plan instead of growing
    to the whole model. prefetch(): ask the kernel to read the range ahead (MADV_WILLNEED).
    check(): raise MemfitError naming the file when it was cut short before the range's end (touching a
    page past a file's end is a SIGBUS).
    """

    __slots__ = ("mapping", "start", "length", "file", "end")

    def __init__(self, file: MappedFile, begin: int, end: int):
        page = mmap.PAGESIZE
        self.file = file
        self.mapping = file.mapping
        self.start = begin // page * page
        self.length = end - self.start
        self.end = end

    def check(self) -> None:
        self.file.check_holds(self.end)

    def release(self) -> None:
        self._advise(getattr(mmap, "MADV_DONTNEED", None))

    def prefetch(self) -> None:
        self._advise(getattr(mmap, "MADV_WILLNEED", None))

    def prefetch_samples(self, numel: int, itemsize: int) -> None:
        """Ask the kernel to read ahead the places same_samples compares (the range holding ``numel`` contiguous
        elements of ``itemsize`` bytes that ends where this one ends): many tensors' samples are then read at
        once instead of one synchronous read at a time while each is checked."""
        option = getattr(mmap, "MADV_WILLNEED", None)
        begin = self.end - numel * itemsize
        page = mmap.PAGESIZE
        for start in sample_starts(numel):
            first = (begin + start * itemsize) // page * page
            last = min(self.end, begin + (start + SAMPLE_COUNT) * itemsize)
            self._advise(option, first, last - first)

    def _advise(self, option, start: int | None = None, length: int | None = None) -> None:
        start = self.start if start is None else start
        length = self.length if length is None else length
        if option is None or length <= 0 or self.mapping.closed:
            return  # not Linux/Unix, or nothing mapped: advice is only ever an optimization
        self.mapping.madvise(option, start, length)


class MappedSafetensors:
    """The safetensors files of one folder, memory-mapped (memfit.safetensors_header.MappedFile);
    ``tensor(key)`` is a zero-copy view."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.files = sorted(self.folder.glob("*.safetensors"))
        self._entries: dict[str, MappedFile] = {}
        for path in self.files:
            mapped = MappedFile(path)
            for key in mapped.entries:
                self._entries.setdefault(key, mapped)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self):
        return self._entries.keys()

    def tensor(self, key: str) -> torch.Tensor:
        return self.shared(key).tensor

    def shared(self, key: str) -> Shared:
        """A zero-copy view of ``key`` with its page range (for release/prefetch advice)."""
        return mapped_view(self._entries[key], key)


def mapped_view(mapped: MappedFile, key: str, view: torch.Tensor | None = None) -> Shared:
    """``key`` of ``mapped`` (or ``view``, a view of it) as a Shared with the page range it covers."""
    tensor = mapped.tensor(key) if view is None else view
    begin, end = mapped.byte_range(key)
    origin = (str(mapped.path), begin, end, str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()),
              tensor.storage_offset())
    if tensor.numel() == 0:
        return Shared(tensor, origin=origin)
    if view is not None:  # only the bytes the view spans (a row slice of a fused tensor covers part of it)
        itemsize = view.element_size()
        last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
        begin, end = begin + view.storage_offset() * itemsize, begin + (view.storage_offset() + last + 1) * itemsize
    return Shared(tensor, MappedPages(mapped, begin, end), origin)


# --- swapping -------------------------------------------------------------------------------------


class SlotKind(TextEnum):
    """Where a Slot's home is: a memory-mapped view of the model's file, a host tensor, or nowhere
    (the tensor itself was moved to the device)."""

    MMAP = "mmap"
    HOST = "host"
    DEVICE = "device"

    @property
    def tier(self) -> str:
        """The plan tier a block of this kind is copied in from, as the timeline names it."""
        return "disk" if self is SlotKind.MMAP else self.value


class Slot:
    """One tensor memfit placed: where it lives outside a forward (``home``) and what to restore
    (its original dtype and device; the values come back from the home, which equals them)."""

    def __init__(self, owner: torch.nn.Module, name: str, tensor: torch.Tensor, home, kind: SlotKind,
                 dtype: torch.dtype | None = None):
        self.owner = owner
        self.kind = kind
        self.name = name
        self.tensor = tensor  # the Parameter / buffer object itself (never replaced)
        self.home = home  # Shared (mmap view) or a host tensor
        self.dtype = dtype or tensor.dtype  # the run dtype, when it differs from the loaded (file) dtype
        self.device = tensor.device

    def home_tensor(self) -> torch.Tensor:
        return self.home.tensor if isinstance(self.home, Shared) else self.home

    @property
    def pages(self) -> MappedPages | None:
        return self.home.pages if isinstance(self.home, Shared) else None


class Modes:
    """The autograd modes a block's run form is made in, captured on the thread that asks for it.

    Inference and grad mode are thread-local and a new thread starts in neither, so a block read
    ahead on the reader thread would otherwise be made of normal tensors whatever its caller runs
    in. Inference mode also wherever a weight of the block is an inference tensor (loaded under
    ``torch.inference_mode()``): such a parameter cannot take a normal tensor as its data (torch
    fails at its next use: "Inference tensors do not track version counter"), in any mode.
    """

    __slots__ = ("inference", "grad")

    def __init__(self, inference: bool, grad: bool):
        self.inference = inference
        self.grad = grad

    @classmethod
    def for_slots(cls, slots: list[Slot]) -> "Modes":
        """The modes of the calling thread, for a run form of ``slots``."""
        inference = torch.is_inference_mode_enabled() or any(slot.tensor.is_inference() for slot in slots)
        return cls(inference, torch.is_grad_enabled())

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        with torch.set_grad_enabled(self.grad), torch.inference_mode(self.inference):
            yield


def inference_mode_for(tensors) -> contextlib.AbstractContextManager:
    """Inference mode where one of ``tensors`` is an inference tensor, for code that gives them new data
    (see Modes); else the caller's modes, unchanged."""
    return torch.inference_mode() if any(t.is_inference() for t in tensors) else contextlib.nullcontext()


class StagingRing:
    """Pinned host slots the disk tier passes through on its way to a device with its own memory.

    A block's memory-mapped weights are read (in the file's dtype) into the next slot, then copied
    to the device from there: a copy from page-locked memory runs asynchronously, a copy straight
    from the mapped file would be a synchronous, staged one. A slot is reused only after the copy
    that read it last has run (an event recorded after that copy), since the copy engine reads the
    slot when it runs, not when it was queued. ``slots`` is the plan's streaming window.
    """

    def __init__(self, device: DeviceRuntime, slot_bytes: int, slots: int):
        self.device = device
        self.slot_bytes = slot_bytes
        self.arena = device.pinned_arena(slot_bytes * slots)
        self._free: list = [None] * slots  # per slot: the event after the copy that read it last
        self._next = 0
        self._lock = threading.Lock()

    def copy_in(self, slots: list[Slot], targets: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Device copies of ``slots``' mapped homes, queued on the current stream through one ring slot: each
        into its ``targets`` entry (device memory laid out by BlockSlots), or new device memory for None."""
        device = self.device
        with self._lock:
            index, self._next = self._next, (self._next + 1) % len(self._free)
            if self._free[index] is not None:
                self._free[index].synchronize()
            offset = index * self.slot_bytes
            out = []
            for slot, target in zip(slots, targets):
                home = slot.home_tensor()
                nbytes = home.numel() * home.element_size()
                # Bytes, not weights: inference mode writes an arena made in it (an inference tensor) as
                # well as one made outside, whatever mode the block's run form is made in.
                with torch.inference_mode():
                    staged = self.arena[offset:offset + nbytes].view(home.dtype).view(home.shape)
                    staged.copy_(home)
                if slot.pages is not None:
                    slot.pages.release()
                out.append(_onto_device(device, staged, slot.dtype, target))  # converted there, after the copy
                offset += aligned(nbytes)
            event = device.new_event()
            event.record(device.current_stream())
            self._free[index] = event
        return out


def _onto_device(device: DeviceRuntime, host: torch.Tensor, dtype: torch.dtype | None,
                 target: torch.Tensor | None) -> torch.Tensor:
    """``host`` on the device in ``dtype``, queued on the current stream: copied into ``target`` (a BlockSlots
    view) where given, else into new device memory."""
    if target is None:
        return device.to_device(host, dtype)
    device.copy_into(target, host)
    return target


class BlockSlots:
    """The device memory streamed blocks run in, on a device with memory of its own: one buffer of the
    plan's streaming window, cut into one slot per block of the window, as large as the window's
    blocks (the largest streamed blocks). It is allocated when the first block streams, so a stage's
    loading holds its resident weights only, as the plan says.

    A block is copied into the smallest free slot it fits, by the stream that copies it, after that
    stream waited, on the device, for the event recorded after the forward that used the slot last:
    the host never waits for the GPU to bring a block in, and no streamed block goes through the
    caching allocator (nothing of its rounding, its per-stream pools or its cached blocks to count
    beside the window). A slot is free for the host as soon as the forward of the block in it has
    been queued, or its read-ahead dropped. A read-ahead that finds no free slot it fits does not
    start; a block needed now that finds none (one nested in another streamed block) is copied on the
    compute stream into memory of its own from the allocator, which that stream reuses in order.
    """

    def __init__(self, device: DeviceRuntime, sizes: list[int]):
        self.device = device
        self.sizes = sorted(sizes, reverse=True)
        self.offsets = [sum(self.sizes[:index]) for index in range(len(self.sizes))]
        self.buffer: torch.Tensor | None = None
        self._last_use: list = [None] * len(self.sizes)  # per slot: the event after its last forward
        self._free = set(range(len(self.sizes)))
        self._lock = threading.Lock()

    def take(self, nbytes: int, modes: "Modes") -> int | None:
        """The smallest free slot of at least ``nbytes``, now the caller's; None when none is free. The
        buffer is made in ``modes`` (those of the blocks' run forms: see Modes)."""
        with self._lock:
            if self.buffer is None:
                with modes.entered():
                    self.buffer = self.device.device_buffer(sum(self.sizes))
            fitting = [index for index in self._free if self.sizes[index] >= nbytes]
            if not fitting:
                return None
            index = min(fitting, key=lambda i: (self.sizes[i], i))
            self._free.discard(index)
            return index

    def lay_out(self, index: int, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        """Views of slot ``index``, one per (shape, dtype), for the current stream to copy into: it waits
        for the slot's last forward first."""
        event = self._last_use[index]
        if event is not None:
            self.device.current_stream().wait_event(event)
        offset = self.offsets[index]
        views = []
        for shape, dtype in shapes:
            nbytes = shape.numel() * dtype.itemsize
            views.append(self.buffer[offset:offset + nbytes].view(dtype).view(shape))
            offset += aligned(nbytes)
        return views

    def give_back(self, index: int, last_use) -> None:
        """Slot ``index`` is free once the device reached ``last_use`` (an event; None: nothing to wait for)."""
        with self._lock:
            self._last_use[index] = last_use
            self._free.add(index)


@dataclass
class ReadAhead:
    """A block read ahead on a device with memory of its own: the slot it is copied into, and its copies
    (device tensors and the event after them), or the reader thread's Future of them."""

    place: int
    work: Future | None = None
    tensors: list = field(default_factory=list)
    event: object = None

    def copies(self) -> tuple[list[torch.Tensor], object]:
        if self.work is not None:
            self.tensors, self.event = self.work.result()
            self.work = None
        return self.tensors, self.event


class Prefetches:
    """The prefetches of one Runtime: the reader thread, the side stream, and the blocks read ahead
    (``pending``, by id(hook): on the CPU the Future of a hook's run form the reader thread works on; on
    a GPU a ReadAhead into one of the ``slots``).

    It holds nothing of the pipeline, so the finalizer of an optimized pipeline that is dropped
    without restore can keep it, and ``settle`` it before the pinned arenas are given back: the
    learned order wraps around (the last streamed block prefetches the first), so when a stage ends
    a read and a copy from the arenas may still be under way, and a block read ahead for a forward
    that never comes holds device memory until it is dropped.
    """

    def __init__(self, device: DeviceRuntime):
        self.device = device
        self.pending: dict[int, Future | ReadAhead] = {}
        self.slots: BlockSlots | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None

    def stream(self):
        if self._stream is None:
            self._stream = self.device.new_stream()
        return self._stream

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=READER_THREAD)
        return self._pool

    def take(self, hook) -> Future | ReadAhead | None:
        return self.pending.pop(id(hook), None)

    def forget(self, pending: Future | ReadAhead | None) -> None:
        """Let go of a block read ahead that will not be used: its slot is free again once its copies ran
        (on the device: no wait here)."""
        if isinstance(pending, Future):
            if not pending.cancel():
                pending.result()
        elif isinstance(pending, ReadAhead):
            cancelled = pending.work is not None and pending.work.cancel()
            self.slots.give_back(pending.place, None if cancelled else pending.copies()[1])

    def drop(self, keep) -> None:
        """Forget every block read ahead but ``keep``'s (read ahead in an order that did not come)."""
        for key in [key for key in self.pending if key != id(keep)]:
            self.forget(self.pending.pop(key))

    def settle(self) -> None:
        """Wait for the reader thread's work and for every copy queued on the device, and drop the
        blocks read ahead: after this nothing reads the pinned arenas or holds a prefetched block."""
        pool, self._pool = self._pool, None
        if pool is not None:
            # A collection can run this finalizer on the reader thread itself, which cannot wait for itself.
            pool.shutdown(wait=not threading.current_thread().name.startswith(READER_THREAD))
        self.device.synchronize()
        for pending in self.pending.values():
            if isinstance(pending, ReadAhead):
                self.slots.give_back(pending.place, None)
        self.pending.clear()


class Runtime:
    """What the hooks of one optimized pipeline share: the device runtime (memfit.devices), the order
    blocks ran in (learned on the first pass, updated on every pass) and the prefetcher.

    Prefetch: on a device with its own memory (a GPU) a side stream copies the next block's host
    tensors while the current block computes (a disk-tier block is first read into the staging
    ring by the reader thread, which then queues its copy); on the CPU a background thread converts
    the next block's memory-mapped weights to the run dtype. The "next block" is the block that
    followed this one the last time it ran, which learns loops (denoising steps) as well as
    straight sequences; before a block has run, the block after it in the plan (``plan_order``),
    mostly execution order, so the first forward prefetches too.

    Resident runs: between two streamed blocks the plan may keep blocks resident, which compute
    with nothing to copy. The first of them to start after a streamed block (a ResidentHook tells)
    reads ahead as many blocks along the order as the window holds, so the copy engine works while
    the resident blocks compute instead of copying one block and idling.

    Blocks in flight: ``window`` streamed blocks at most hold device memory at once (the plan's
    1 + prefetch): those running, those read ahead, and those whose forward the GPU may still be
    running. They run in the ``slots`` (BlockSlots), whose reuse the device orders by an event
    recorded after every streamed block's forward, so the host never waits for the GPU to bring a
    block in.
    """

    def __init__(self, device: DeviceRuntime, prefetch: bool = True, window: int = 2):
        self.device_runtime = device
        self.device = device.device
        self.prefetch = prefetch
        self.window = max(1, window)
        self.next_of: dict[int, "SwapHook"] = {}
        self.last: "SwapHook | None" = None
        self.ring: StagingRing | None = None
        self.slots: BlockSlots | None = None
        self.prefetches = Prefetches(device)
        self._ended: "SwapHook | None" = None  # the streamed block that ended last, until another starts

    def __deepcopy__(self, memo):
        # A copy gets its own prefetcher and learns its own order; threads and streams cannot be copied.
        copy = Runtime(self.device_runtime, self.prefetch, self.window)
        copy.ring = self.ring  # the ring's lock and events keep the two copies' slots apart
        copy.use_slots(self.slots)  # and so do the block slots'
        memo[id(self)] = copy
        return copy

    @property
    def separate_memory(self) -> bool:
        return self.device_runtime.separate_memory

    def use_slots(self, slots: BlockSlots | None) -> None:
        self.slots = self.prefetches.slots = slots

    def take_slot(self, hook: "SwapHook", modes: "Modes") -> int | None:
        """A free slot ``hook``'s block fits in (BlockSlots.take), or None (none, or no slots: every block
        the stage streams is one it does not run)."""
        return None if self.slots is None else self.slots.take(hook.run_bytes, modes)

    def plan_order(self, hooks: list["SwapHook"]) -> None:
        """Take one component's hooks in plan order as the order until they have run (see the class
        docstring); not around its end: whether a component runs again is learned. Only on a device with
        memory of its own: on the CPU a block asks the kernel for its pages as it runs, and a read ahead in
        an order that does not come (a UNet's mid block runs after its up blocks are registered) would read
        blocks twice."""
        if not self.separate_memory:
            return
        for hook, after in zip(hooks, hooks[1:]):
            self.next_of.setdefault(id(hook), after)

    def entering(self, hook: "SwapHook") -> None:
        """``hook``'s block is about to be swapped in: learn the order from it."""
        if self.last is not None and self.last is not hook:
            if self.next_of.get(id(self.last), hook) is not hook:
                # Read ahead for an order that did not come: those blocks would hold the window's memory
                # until they run, maybe never (the plan's order on a first pass, a component's last call).
                self.prefetches.drop(keep=hook)
            self.next_of[id(self.last)] = hook
        self.last = hook
        self._ended = None

    def entered(self, hook: "SwapHook") -> None:
        """``hook``'s block runs: start the copy of the block after it."""
        upcoming = self.next_of.get(id(hook))
        if self.prefetch and upcoming is not None and upcoming is not hook:
            upcoming.start_prefetch()

    def finished(self, hook: "SwapHook") -> None:
        """``hook``'s forward is queued: its slot is free for blocks copied after the device ran it."""
        if hook.place is not None:
            event = self.device_runtime.new_event()
            event.record(self.device_runtime.current_stream())
            self.slots.give_back(hook.place, event)
            hook.place = None
        self._ended = hook

    def resident_entered(self) -> None:
        """A resident block starts. The first after a streamed block starts the copies of the blocks
        after that one in the order, as many as the window's free slots hold."""
        hook, self._ended = self._ended, None
        if hook is None or not self.prefetch:
            return
        upcoming = self.next_of.get(id(hook))
        for _ in range(self.window):
            if upcoming is None or upcoming is hook or not upcoming.start_prefetch():
                return
            upcoming = self.next_of.get(id(upcoming))

    def close(self) -> None:
        self.prefetches.settle()


class ResidentHook(ModuleHook):
    """Tells the runtime that a block kept on the device starts, so that the copies of the streamed
    blocks after it start while it computes (Runtime.resident_entered). Nothing of the block changes."""

    name = "memfit.resident"

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def pre_forward(self, module) -> None:
        self.runtime.resident_entered()


class SwapHook(ModuleHook):
    """Swap a block's tensors to their run form for the forward and back to their home after.

    Run form: on a GPU, a device copy of the home (pinned host tensor, or mmap view through the
    staging ring); on the CPU, the mmap view converted to the run dtype. Outside a forward every
    tensor is its home: real data.
    """

    name = "memfit.swap"

    def __init__(self, block: str, slots: list[Slot], runtime: Runtime):
        self.block = block
        self.slots = slots
        self.runtime = runtime
        self._depth = 0  # a module re-entered (rare; e.g. a shared submodule) swaps once
        self.pinned = False  # kept in its run form between forwards (pin): resident for a phase of the stage
        self.place: int | None = None  # the runtime's slot its run form is in, while it is (on a GPU)

    @functools.cached_property
    def run_shapes(self) -> list[tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of each slot's run form on a device with memory of its own."""
        return [(slot.home_tensor().shape, slot.dtype or slot.home_tensor().dtype) for slot in self.slots]

    @property
    def run_bytes(self) -> int:
        """The device memory its run form takes in a slot of BlockSlots."""
        return sum(aligned(shape.numel() * dtype.itemsize) for shape, dtype in self.run_shapes)

    def pin(self) -> None:
        """Bring the block in and keep it until ``unpin``: resident while its phase runs (Phases). On the
        CPU a weight in its run dtype is used in place, as a plain load holds it: the file's pages, read
        now and counted in RSS until unpin drops them (the same addresses as plain diffusers' weights, so
        the same kernels and sums run); a converted one is memory of the process's own, freed by unpin."""
        if self.pinned:
            return
        self.runtime.prefetches.forget(self.runtime.prefetches.take(self))  # made here, not in a slot
        started = time.perf_counter()
        if self.runtime.separate_memory:
            tensors = self._materialize(Modes.for_slots(self.slots))
        else:
            tensors = []
            with Modes.for_slots(self.slots).entered():
                for slot in self.slots:
                    if slot.pages is not None:
                        slot.pages.prefetch()
                    home = slot.home_tensor()
                    tensors.append(home.to(slot.dtype))
                    if slot.pages is not None and home.dtype != slot.dtype:
                        slot.pages.release()  # converted: the mapped pages are not needed any more
            record_move(self.block, self.slots[0].kind.tier if self.slots else "host", "device",
                        sum(t.numel() * t.element_size() for t in tensors), started, time.perf_counter())
        for slot, tensor in zip(self.slots, tensors):
            slot.tensor.data = tensor
        self.pinned = True

    def unpin(self) -> None:
        """Send a pinned block back to its home: its run form is freed."""
        if not self.pinned:
            return
        started = time.perf_counter()
        nbytes = sum(slot.tensor.numel() * slot.tensor.element_size() for slot in self.slots)
        for slot in self.slots:
            slot.tensor.data = slot.home_tensor()
            if slot.pages is not None:
                slot.pages.release()
        self.pinned = False
        record_move(self.block, "device", self.slots[0].kind.tier if self.slots else "host", nbytes, started,
                    time.perf_counter())

    @functools.cached_property
    def _last_pages_per_file(self) -> list[MappedPages]:
        """Per file the block is read from, its tensor that ends last in it."""
        last: dict[int, MappedPages] = {}
        for slot in self.slots:
            pages = slot.pages
            if pages is not None and (id(pages.file) not in last or pages.end > last[id(pages.file)].end):
                last[id(pages.file)] = pages
        return list(last.values())

    @property
    def reads_files(self) -> bool:
        return any(slot.kind == SlotKind.MMAP for slot in self.slots)

    def _materialize(self, modes: Modes, place: int | None = None) -> list[torch.Tensor]:
        """The run form of every slot, made in ``modes``; on a GPU queued on the current stream, into the
        runtime's slot ``place`` where given."""
        with modes.entered():
            return self._run_form(place)

    def _run_form(self, place: int | None = None) -> list[torch.Tensor]:
        started = time.perf_counter()
        device = self.runtime.device_runtime
        ring = self.runtime.ring
        if device.separate_memory:
            targets = [None] * len(self.slots) if place is None else self.runtime.slots.lay_out(place, self.run_shapes)
            ringed = [i for i, slot in enumerate(self.slots) if ring is not None and slot.kind == SlotKind.MMAP]
            staged = dict(zip(ringed, ring.copy_in([self.slots[i] for i in ringed], [targets[i] for i in ringed]))
                          if ringed else ())
            out = [staged[i] if i in staged else _onto_device(device, slot.home_tensor(), slot.dtype, targets[i])
                   for i, slot in enumerate(self.slots)]
        else:
            for pages in self._last_pages_per_file:
                pages.check()  # the file still holds the block: a page past its end would be a SIGBUS
            for slot in self.slots:
                if slot.pages is not None:
                    # Ask the kernel for the whole block at once: large sequential reads, instead of
                    # one page fault at a time while it is converted or used in place.
                    slot.pages.prefetch()
            out = []
            for slot in self.slots:
                home = slot.home_tensor()
                out.append(home.to(slot.dtype, copy=home.dtype != slot.dtype))
                if slot.pages is not None and home.dtype != slot.dtype:
                    slot.pages.release()  # converted: the mapped pages are not needed any more
        # On a GPU the end is when the copies were queued (they run on the side stream); on the CPU
        # a block used in place is only read ahead here, so the end is when the kernel was asked.
        record_move(self.block, self.slots[0].kind.tier if self.slots else "host",
                    "device", sum(t.numel() * t.element_size() for t in out), started, time.perf_counter())
        return out

    def _copy_on(self, stream, modes: Modes, place: int) -> tuple[list[torch.Tensor], object]:
        device = self.runtime.device_runtime
        with device.use_stream(stream):
            tensors = self._materialize(modes, place)
            event = device.new_event()
            event.record(stream)
        return tensors, event

    def start_prefetch(self) -> bool:
        """Start reading this block ahead; False when it did not start: it is running, or (on a GPU) no
        free slot of the runtime fits it."""
        prefetches = self.runtime.prefetches
        if id(self) in prefetches.pending:
            return True
        if self._depth or self.pinned:
            return False
        device = self.runtime.device_runtime
        modes = Modes.for_slots(self.slots)  # this thread's, for the reader thread too
        if device.separate_memory:
            place = self.runtime.take_slot(self, modes)
            if place is None:
                return False
            stream = prefetches.stream()  # ordered after the slot's last forward by BlockSlots.lay_out, no more
            if self.reads_files:
                # Reading the file into the ring is host work: the reader thread does it (and queues
                # the copy after it) while this thread goes on queuing the current block's kernels.
                pending = ReadAhead(place, work=prefetches.pool().submit(self._copy_on, stream, modes, place))
            else:
                pending = ReadAhead(place, None, *self._copy_on(stream, modes, place))
        else:
            pending = prefetches.pool().submit(self._materialize, modes)
        prefetches.pending[id(self)] = pending
        return True

    def _take(self) -> list[torch.Tensor]:
        pending = self.runtime.prefetches.take(self)
        device = self.runtime.device_runtime
        if pending is None:
            modes = Modes.for_slots(self.slots)
            if device.separate_memory:  # no free slot: memory of its own (see BlockSlots)
                self.place = self.runtime.take_slot(self, modes)
            # queued on the current stream: later work there sees it
            return self._materialize(modes, self.place)
        if isinstance(pending, Future):
            return pending.result()
        self.place = pending.place
        tensors, event = pending.copies()
        device.current_stream().wait_event(event)
        return tensors

    def pre_forward(self, module) -> None:
        if self.pinned:
            return
        self._depth += 1
        if self._depth > 1:
            return
        self.runtime.entering(self)
        for slot, tensor in zip(self.slots, self._take()):
            slot.tensor.data = tensor
        self.runtime.entered(self)

    def post_forward(self, module) -> None:
        if self.pinned:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        for slot in self.slots:
            slot.tensor.data = slot.home_tensor()
            if slot.pages is not None:
                slot.pages.release()
        self.runtime.finished(self)

    def deinitialize(self, module) -> None:
        self.runtime.prefetches.forget(self.runtime.prefetches.take(self))

    def __deepcopy__(self, memo):
        import copy

        new = SwapHook.__new__(SwapHook)
        memo[id(self)] = new
        new.block = self.block
        new.slots = copy.deepcopy(self.slots, memo)
        new.runtime = copy.deepcopy(self.runtime, memo)  # with no prefetch in flight: those are the original's
        new._depth = 0
        new.pinned = False
        new.place = None
        return new


class Phases:
    """The phases of a stage whose components run one at a time (Wan 2.2's two experts): each phase's
    blocks that its plan keeps resident are SwapHooks pinned while it runs. A PhaseSwitch on each
    phase's component enters its phase at the component's call: the blocks of the phase before are
    unpinned first (their memory freed), then the phase's own pinned, so the two never add up."""

    def __init__(self, pinned: list[list[SwapHook]]):
        self.pinned = pinned
        self.active: int | None = None

    def enter(self, index: int) -> None:
        if index == self.active:
            return
        self.leave()
        self.active = index
        for hook in self.pinned[index]:
            hook.pin()

    def leave(self) -> None:
        """Unpin the phase running (optimize's undo)."""
        if self.active is not None:
            for hook in self.pinned[self.active]:
                hook.unpin()
        self.active = None


class PhaseSwitch(ModuleHook):
    """On a phase's component: entering its forward enters its phase (Phases.enter). Registered before
    the component's own SwapHooks, so the blocks are pinned before any of them would swap in."""

    name = "memfit.phase"

    def __init__(self, phases: Phases, index: int):
        self.phases = phases
        self.index = index

    def pre_forward(self, module) -> None:
        self.phases.enter(self.index)
