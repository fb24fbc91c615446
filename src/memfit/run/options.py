"""A run's options as one value: what every stage of a run is loaded, fitted and run with.

memfit.generate (and memfit.encode, the refiner workflow, a Session) builds one RunOptions from its
keyword arguments; the stage runner and the fitting read it, nothing passes the same dozen keyword
arguments on. The device is checked here, once, before anything loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from memfit.devices import DeviceRuntime, cuda_device_count, runtime_for
from memfit.dtypes import parse_dtype
from memfit.errors import MemfitError
from memfit.run.threads import check_threads

__all__ = ["RunOptions", "StagePool", "default_device", "resolve_device"]

# Devices memfit places whole components on without streaming, and how to ask torch whether one is here.
_PLAIN_DEVICES = {
    "mps": lambda: torch.backends.mps.is_available(),
    "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
}


class StagePool(Protocol):
    """Stage pipelines kept loaded between runs (memfit.run.session.WarmPool is the one memfit has).

    A stage hands its fitted pipeline to the pool instead of dropping it (``keep``, with its StageFit), and the
    next run's stage takes both back (``take``) instead of loading and fitting again, and runs as that fit
    decided (its strategy: chunked attention, a split batch, the heap for temporaries); ``slot`` names the stage's load,
    ``made_for`` what the pipeline was made for (a pipe made for something else is never handed out).
    ``host_tiers`` (memfit.run.executor.KeptHostTiers) keeps the pinned host tiers of streaming stages on a
    GPU between runs.
    """

    host_tiers: Any

    def take(self, slot: tuple, made_for: tuple) -> tuple[Any, Any]: ...

    def keep(self, slot: tuple, made_for: tuple, pipe: Any, fit: Any) -> None: ...

    def holds_any(self) -> bool: ...

    def give_up(self, reason: str) -> None:
        """Release every kept pipeline and keep none from now on."""

    def make_room(self, stage: str, in_use: int, limit: int | None) -> None:
        """Before the kept ``stage`` runs: free what the pool can spare unless the stage is known to fit."""

    def free_buffers(self) -> None:
        """Free the kept compiled models' intermediate buffers (before a stage is planned under a budget)."""

    def release_smallest(self, *, spare_largest: bool = False) -> bool:
        """Let the smallest kept pipeline go (and keep its slot no more) to make room for a stage; False if none."""

    def note_growth(self, stage: str, grew_by: int, *, loaded: bool) -> None:
        """How much ``stage``'s run grew the memory in use; ``loaded``: it loaded rather than took its pipe."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The settings every stage of one run shares.

    dtype:        the weights' dtype ("fp32", "bf16", "fp16"); ``torch_dtype`` is torch's.
    device:       where torch places the run's tensors; ``runtime`` is memfit's handle on it
                  (memfit.devices), whose ``memory_in_use`` every budget starts from.
    budget:       what the caller passed ("auto", "none", bytes, a size string, a Budget); the runner
                  resolves it once, at the start of the run.
    backend, fallback: how stages compile their components (memfit.compile) and what a failure falls back to.
    progress:     show the pipeline's own progress bars.
    allow_pickle: load pickle checkpoints with torch's weights_only loader.
    pool:         a StagePool that keeps stages loaded between runs (a Session's), or None.
    on_step:      ``on_step(stage, 0, 0)`` as each stage starts and ``on_step(stage, done, total)`` as the
                  denoising loop advances; it may raise to stop the run.
    threads:      the threads torch computes with during the run; None: the CPUs this process may use
                  (memfit.run.threads).
    """

    dtype: str = "fp32"
    device: torch.device = torch.device("cpu")
    runtime: DeviceRuntime = dataclasses.field(default_factory=lambda: runtime_for("cpu"))
    budget: Any = "auto"
    backend: Any = None
    fallback: str | None = None
    progress: bool = True
    allow_pickle: bool = False
    pool: StagePool | None = None
    on_step: Callable[[str, int, int], None] | None = None
    threads: int | None = None

    @classmethod
    def build(cls, *, device: str | torch.device | DeviceRuntime | None = None, threads=None,
              **options) -> "RunOptions":
        """RunOptions with ``device`` checked to exist here (None: the GPU if there is one, else the CPU) and
        ``threads`` to be a count.

        A memfit.devices runtime is taken as it is: tests pass runtime doubles this way.
        """
        options["threads"] = check_threads(threads)
        if isinstance(device, DeviceRuntime):
            return cls(device=device.device, runtime=device, **options)
        resolved = resolve_device(device)
        return cls(device=resolved, runtime=runtime_for(resolved), **options)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


def default_device() -> torch.device:
    """Where a run executes when the caller names no device: the GPU if there is one."""
    return torch.device("cuda" if cuda_device_count() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a run executes on: ``device`` checked to exist on this machine, else the default."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise MemfitError(f"--device {device} is not a device torch knows; use cpu, cuda or cuda:N.") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type in _PLAIN_DEVICES:
        if not _PLAIN_DEVICES[resolved.type]():
            raise MemfitError(f"--device {device} names a {resolved.type} device but torch {torch.__version__} sees "
                              "none here; use --device cpu.")
        return resolved
    if resolved.type != "cuda":
        raise MemfitError(f"--device {device} is not supported by memfit; use cpu, cuda, cuda:N, mps or xpu.")
    count = cuda_device_count()
    if count == 0:
        raise MemfitError(f"--device {device} names a CUDA GPU but torch sees none here; use --device cpu.")
    if resolved.index is not None and resolved.index >= count:
        raise MemfitError(
            f"--device {device} does not exist: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}.")
    return resolved
