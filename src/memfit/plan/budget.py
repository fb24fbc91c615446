"""Memory budgets: what a run may use on each tier, and what this machine can spare.

A budget is always in bytes (memfit.sizes parses "6GiB" and "6GB"). This module imports torch
only inside ``detect_budget`` (and only when asked about a CUDA device), so budgets stay cheap
for the CLI and the pure planner.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, Union

from memfit.errors import MemfitError
from memfit.sizes import parse_size

__all__ = [
    "Budget",
    "BudgetLike",
    "DEFAULT_DEVICE_RESERVE",
    "DEFAULT_HOST_RESERVE",
    "available_host_memory",
    "cgroup_free_memory",
    "detect_budget",
]

# What detect_budget leaves unused. On a GPU the CUDA context, the caching allocator's
# fragmentation and cuBLAS/cuDNN workspaces live outside what the planner counts; on the host the
# Python process itself, the OS page cache for memory-mapped weights and other programs need room.
DEFAULT_DEVICE_RESERVE = 512 * 2**20
DEFAULT_HOST_RESERVE = 2 * 2**30

# cgroup v1 reports "no limit" as a page-rounded LONG_MAX (9223372036854771712); anything this
# large (1 PiB) cannot be a real limit on one machine.
_NO_LIMIT_ABOVE = 2**50




@dataclasses.dataclass(frozen=True)
class Budget:
    """How much memory memfit may use, per tier.

    device: bytes on the execution device (GPU memory, or RAM when running on the CPU).
    host:   bytes of host RAM for weights parked off the device. On a CPU-only run host and device
            are the same RAM: pass host=0 so anything not resident streams from disk.
    disk:   a directory memfit may use for memory-mapped weights; None means no disk tier.
    None for device or host means "no limit"; resolve unknown limits with ``detect_budget`` first.
    """

    device: int | None = None
    host: int | None = None
    disk: str | None = None

    def __post_init__(self) -> None:
        for field in ("device", "host"):
            raw = getattr(self, field)
            if raw is not None:
                # Accept strings here too, so Budget(device="4GiB") reads the way people write it.
                object.__setattr__(self, field, _parse_field(field, raw))
        if self.disk is not None:
            object.__setattr__(self, "disk", os.fspath(self.disk))

    @classmethod
    def of(cls, value: "BudgetLike") -> "Budget":
        """Widen a scalar or mapping into a Budget: 4_000_000_000 or "4GiB" is a device budget,
        {"device": "4GiB", "host": "16GiB", "disk": "/tmp/x"} sets each tier, a Budget is returned as is.
        """
        if isinstance(value, Budget):
            return value
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            return cls(device=parse_size(value))
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"device", "host", "disk"})
            if unknown:
                raise MemfitError(
                    f"Unknown budget key(s) {unknown}; a budget mapping may have 'device', 'host' and 'disk', "
                    'e.g. {"device": "4GiB", "host": "16GiB", "disk": "/var/tmp/memfit"}.'
                )
            return cls(device=value.get("device"), host=value.get("host"), disk=value.get("disk"))
        raise MemfitError(
            f"Cannot use {value!r} as a budget; pass bytes (int), a size string like \"6GiB\", "
            "a dict with device/host/disk, or a memfit.Budget."
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


BudgetLike = Union[Budget, int, str, Mapping]


def _parse_field(field: str, raw: object) -> int:
    try:
        return parse_size(raw)  # type: ignore[arg-type]
    except MemfitError as exc:
        raise MemfitError(f"Budget {field}: {exc}") from None


# --- detection --------------------------------------------------------------------------------


def detect_budget(
    device: str | None = None,
    reserve: int | str | None = None,
    *,
    proc_root: str | os.PathLike = "/proc",
    sys_root: str | os.PathLike = "/sys",
) -> Budget:
    """Measure what memfit may use right now and return it as a Budget.

    With a CUDA ``device`` ("cuda", "cuda:1"): device = free device memory
    (``torch.cuda.mem_get_info``) minus ``reserve`` (default 512 MiB); host = available RAM minus
    2 GiB. Without one (None or "cpu"): device = available RAM minus ``reserve`` (default 2 GiB)
    and host = 0, because on the CPU the device *is* host memory, so nothing can be parked
    separately. Available RAM is the smaller of MemAvailable (/proc/meminfo, psutil as a fallback)
    and the free room under this process's cgroup memory limit (v2 and v1 both read).

    ``proc_root`` and ``sys_root`` exist so tests can point at fake /proc and /sys trees.
    """
    host_available = available_host_memory(proc_root=proc_root, sys_root=sys_root)
    if device is not None and str(device).startswith("cuda"):
        device_reserve = DEFAULT_DEVICE_RESERVE if reserve is None else parse_size(reserve)
        free = _cuda_free_bytes(device)
        return Budget(
            device=max(0, free - device_reserve),
            host=max(0, host_available - DEFAULT_HOST_RESERVE),
        )
    if device is not None and str(device) != "cpu":
        raise MemfitError(
            f"detect_budget does not know device {device!r}; use 'cpu', 'cuda' or 'cuda:N', "
            "or pass an explicit budget such as budget=\"6GiB\"."
        )
    host_reserve = DEFAULT_HOST_RESERVE if reserve is None else parse_size(reserve)
    return Budget(device=max(0, host_available - host_reserve), host=0)


def _cuda_free_bytes(device: str) -> int:
    import torch  # local: budget parsing must not pay for importing torch

    if not torch.cuda.is_available():
        raise MemfitError(
            f"Device {device!r} was requested but torch reports no CUDA device "
            f"(torch {torch.__version__}). Use device='cpu' or install a CUDA build of torch."
        )
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def available_host_memory(
    *, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"
) -> int:
    """Bytes of RAM this process could still allocate: min(MemAvailable, cgroup limit - usage)."""
    candidates = [_mem_available(Path(proc_root))]
    cgroup_room = cgroup_free_memory(proc_root=proc_root, sys_root=sys_root)
    if cgroup_room is not None:
        candidates.append(cgroup_room)
    return min(candidates)


def _mem_available(proc: Path) -> int:
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            # The kernel always writes "kB" here and means KiB.
            return int(parts[1]) * 1024
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        raise MemfitError(
            f"Cannot find MemAvailable in {proc / 'meminfo'} and psutil is not installed; "
            "pass an explicit budget such as budget=\"6GiB\"."
        ) from None
    return int(psutil.virtual_memory().available)


def cgroup_free_memory(
    *, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"
) -> int | None:
    """Room left under this process's cgroup memory limit, or None when there is no limit.

    Reads /proc/self/cgroup to find our own cgroup (containers often nest it), then cgroup v2
    ``memory.max`` / ``memory.current`` or cgroup v1 ``memory.limit_in_bytes`` /
    ``memory.usage_in_bytes`` under /sys/fs/cgroup.
    """
    proc, cgroup_fs = Path(proc_root), Path(sys_root) / "fs" / "cgroup"
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        # Format "hierarchy-id:controllers:path"; v2 is the single "0::/path" line.
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        relative = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            room = _cgroup_room(cgroup_fs / relative, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            room = _cgroup_room(cgroup_fs / "memory" / relative, "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        if room is not None:
            return room
    return None


def _cgroup_room(directory: Path, limit_file: str, usage_file: str) -> int | None:
    try:
        raw_limit = (directory / limit_file).read_text().strip()
    except OSError:
        return None
    if raw_limit in ("", "max"):
        return None
    limit = int(raw_limit)
    if limit >= _NO_LIMIT_ABOVE:
        return None
    try:
        usage = int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        usage = 0  # without a usage figure the limit itself is the best upper bound we have
    return max(0, limit - usage)
