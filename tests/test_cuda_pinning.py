"""How CudaRuntime page-locks its pinned arenas (issue 34, items 3 and 4), against a stubbed CUDA runtime
(torch.cuda.cudart) that locks whole pages as the driver does and refuses a range touching a locked page
with cudaErrorHostMemoryAlreadyRegistered (712), and a torch.cuda.device that records which GPU is current.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import warnings

import pytest
import torch

from memfit.devices import HOST_MEMORY_ALREADY_REGISTERED, HOST_REGISTER_PORTABLE, CudaRuntime, PinningWarning
from memfit.sizes import format_bytes

PAGE = mmap.PAGESIZE
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713


class StubCudart:
    """cudaHostRegister / cudaHostUnregister with the driver's page granularity; ``refuse`` makes every
    registration return that error instead."""

    def __init__(self, current: list, refuse: int | None = None):
        self.current = current  # the stack torch.cuda.device pushes to
        self.refuse = refuse
        self.locked: dict[int, range] = {}  # address -> the pages registered there
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address, length, flags):
        pages = range(address // PAGE, -(-(address + length) // PAGE))
        self.calls.append(("register", address, length, flags, self.current[-1] if self.current else None))
        if self.refuse is not None:
            return self.refuse
        if any(set(pages) & set(locked) for locked in self.locked.values()):
            return HOST_MEMORY_ALREADY_REGISTERED
        self.locked[address] = pages
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address, None, None, self.current[-1] if self.current else None))
        return 0 if self.locked.pop(address, None) is not None else CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED


@pytest.fixture
def cudart(monkeypatch):
    """The stub, installed; ``cudart.errors_forgotten`` counts the runtime's calls to drop CUDA's last error."""
    current: list = []

    @contextlib.contextmanager
    def device(which):
        current.append(torch.device(which))
        try:
            yield
        finally:
            current.pop()

    stub = StubCudart(current)
    stub.errors_forgotten = 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: stub)
    monkeypatch.setattr(torch.cuda, "device", device)

    def forget(self):
        stub.errors_forgotten += 1

    monkeypatch.setattr(CudaRuntime, "_forget_error", forget)
    return stub


def registrations(stub):
    return [call for call in stub.calls if call[0] == "register"]


def test_arenas_are_page_locked_portably_from_their_own_gpu_in_pages_of_their_own(cudart):
    """Item 3: cudaHostRegisterPortable, with the runtime's GPU current (cuda:1 here, not the default GPU 0).
    Item 4: each arena starts on a page and is registered in whole pages of its own, so two small arenas
    never share a page (the second registration used to fail with 712, which optimize raised)."""
    runtime = CudaRuntime(torch.device("cuda", 1))
    runtime.pinned_limit = 1 << 30
    small, other = runtime.pinned_arena(100), runtime.pinned_arena(PAGE + 1)
    assert (small.numel(), other.numel()) == (100, PAGE + 1)  # exactly what was asked for
    assert [(flags, device) for _, _, _, flags, device in registrations(cudart)] == [
        (HOST_REGISTER_PORTABLE, torch.device("cuda", 1))] * 2
    pages = [(address % PAGE, length) for _, address, length, _, _ in registrations(cudart)]
    assert pages == [(0, PAGE), (0, 2 * PAGE)]
    assert runtime.pinned_bytes() == 3 * PAGE and cudart.errors_forgotten == 0
    runtime.release_arena(small)
    runtime.release_arena(other)
    unregistered = [call for call in cudart.calls if call[0] == "unregister"]
    assert [(address, device) for _, address, _, _, device in unregistered] == [
        (small.data_ptr(), torch.device("cuda", 1)), (other.data_ptr(), torch.device("cuda", 1))]
    assert runtime.pinned_bytes() == 0 and not cudart.locked


def test_memory_another_library_locked_is_used_as_it_is_and_never_unlocked(cudart):
    """Item 4: error 712 (the pages are page-locked already) is handled: the arena is usable as pinned memory,
    CUDA's last error is dropped (torch would raise it at its next kernel), and memfit does not unlock it."""
    cudart.refuse = HOST_MEMORY_ALREADY_REGISTERED
    runtime = CudaRuntime(torch.device("cuda", 0))
    runtime.pinned_limit = 1 << 30
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinningWarning)
        arena = runtime.pinned_arena(10 * PAGE)
    assert cudart.errors_forgotten == 1 and runtime.pinned_bytes() == 0
    runtime.release_arena(arena)
    assert len(cudart.calls) == 1  # registered once, never unregistered


def test_a_failed_registration_falls_back_to_pageable_memory_and_says_so(cudart):
    """Item 4: a registration the driver refuses (here out of memory, as where the OS caps page-locked
    memory) gives a pageable arena and a PinningWarning naming the error, instead of failing the run."""
    cudart.refuse = CUDA_ERROR_MEMORY_ALLOCATION
    runtime = CudaRuntime(torch.device("cuda", 0))
    runtime.pinned_limit = 1 << 30
    with pytest.warns(PinningWarning, match=rf"could not page-lock {re.escape(format_bytes(10 * PAGE))} .*CUDA error 2"
                                            ".*pageable memory"):
        arena = runtime.pinned_arena(10 * PAGE)
    assert arena.numel() > 0 and runtime.pinned_bytes() == 0 and cudart.errors_forgotten == 1
    runtime.release_arena(arena)
    assert not [call for call in cudart.calls if call[0] == "unregister"]


def test_page_locked_memory_is_capped(cudart):
    """Item 4: no more than ``pinned_limit`` is page-locked at once (by default a share of the host's RAM,
    less on Windows and WSL); an arena past it is pageable, with a warning, and is not even tried."""
    runtime = CudaRuntime(torch.device("cuda", 0))
    runtime.pinned_limit = 3 * PAGE
    first = runtime.pinned_arena(2 * PAGE)
    with pytest.warns(PinningWarning, match="memfit locks at most"):
        runtime.pinned_arena(2 * PAGE)
    assert len(registrations(cudart)) == 1 and runtime.pinned_bytes() == 2 * PAGE
    runtime.release_arena(first)
    runtime.pinned_arena(3 * PAGE)
    assert len(registrations(cudart)) == 2 and runtime.pinned_bytes() == 3 * PAGE
