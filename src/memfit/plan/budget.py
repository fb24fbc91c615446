"""Memory budgets: what a run may use on each tier, and what this machine can spare.

A budget is always in bytes (memfit.sizes parses "6GiB" and "6GB"). This module imports torch
only inside ``detect`` (and only when asked about a CUDA device), so budgets stay cheap
for the CLI and the pure planner.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, NamedTuple, Union

from memfit.errors import MemfitError
from memfit.sizes import format_bytes, parse_size, round_up_mib

__all__ = [
    "ABOVE_PROCESS",
    "AUTO",
    "NONE",
    "Budget",
    "BudgetLike",
    "DEFAULT_DEVICE_RESERVE",
    "DEFAULT_HOST_RESERVE",
    "HostMemory",
    "ResolvedBudget",
    "available_host_memory",
    "cgroup_free_memory",
    "BudgetTooSmall",
    "CgroupUsage",
    "StageDoesNotFit",
    "above_process_size",
    "detect",
    "device_reserve",
    "host_reserve",
    "own_cgroup_usage",
    "read_host_memory",
    "resolve_budget",
    "stage_budget",
    "stage_start_budget",
]

# What detection leaves unused. On a GPU the CUDA context, the caching allocator's fragmentation and
# cuBLAS/cuDNN workspaces live outside what the planner counts; on the host the page cache of
# memory-mapped weights read ahead, allocator slack and other programs need room. Both reserves scale
# with the memory there is (a fixed 2 GiB would leave nothing of a 2 GiB container): an eighth of it
# on the host and a sixteenth on a GPU, between a floor and these ceilings.
DEFAULT_DEVICE_RESERVE = 2**30
DEFAULT_HOST_RESERVE = 2 * 2**30
_MIN_HOST_RESERVE = 64 * 2**20
_MIN_DEVICE_RESERVE = 256 * 2**20

AUTO = "auto"  # detect what this machine (container, GPU) can spare at the start of the run
NONE = "none"  # no budget: planning off, every component loads whole
# "+SIZE": a device budget for what each stage adds to what the process holds as the stage starts (its weights
# and activations), leaving out the process itself (Python, torch, the libraries: some 400 MiB on a CPU, more or
# less from machine to machine). One such budget plans a model the same way on every machine.
ABOVE_PROCESS = "above-process"

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
    None for device or host means "no limit"; resolve unknown limits with ``detect`` first.
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


class StageDoesNotFit(MemfitError):
    """No plan fits a stage's components and activations into the budget left for it."""


class BudgetTooSmall(StageDoesNotFit):
    """A budget below the smallest that can work, in the one form every such refusal takes: the budget
    the user gave, the smallest that works (in bytes, which scripts read back) and what it is made of.

    ``needed`` and ``parts`` are kept so that a caller that knows more (the memory this process holds
    beside a stage's own floor) can refuse again in the same form with the user's figures.
    """

    def __init__(self, given: int, needed: int, parts: str, advice: str = "", *, above: bool = False,
                 on_top: bool = False):
        """``above``: more than ``needed`` is needed (how much more is not known here); ``on_top``: the budget was
        given as "+SIZE", on top of what the process holds, and so are the figures named."""
        self.given, self.needed, self.parts, self.advice = given, needed, parts, advice
        plus = "+" if on_top else ""
        super().__init__(
            f"The budget of {plus}{format_bytes(given)} is below the smallest that can work for this run: the smallest "
            f"budget that works is {'above ' if above else ''}{plus}{needed} bytes ({plus}{format_bytes(needed)}: "
            f"{parts}). Give --budget {'more than ' if above else ''}{plus}{round_up_mib(needed)}MiB"
            f"{'' if above else ' or more'}{advice}."
        )

    def counting(self, given: int, held: int, what: str = "Python, torch, the libraries") -> "BudgetTooSmall":
        """This refusal of what was left for a stage, again for the ``given`` budget the user passed, of
        which the process already ``held`` that much (``what``)."""
        return BudgetTooSmall(given, held + self.needed, f"{format_bytes(held)} for this process ({what}), plus "
                              f"{format_bytes(self.needed)} for {self.parts}", self.advice)


def stage_budget(budget: Budget, device, *, already_used: int = 0, stream_from: str | None = None,
                 loaded: bool = False, host_in_use: int = 0, kept_host: int = 0) -> Budget:
    """What the run's ``budget`` means for one stage's weights and activations on ``device`` (a
    memfit.devices runtime): the one rule the stage runner and memfit.optimize share, on any device.

    device: what is left once ``already_used`` is counted (what the process holds now: Python, torch,
            the libraries, stages kept loaded); a budget already used up is refused (BudgetTooSmall).
    host:   on a device with memory of its own the host tier is page-locked RAM: bounded by what the
            host has available now (less a reserve) where the budget names no host part, never
            unlimited; ``host_in_use``, the pipeline's weights that sit in host RAM now, is added,
            since the host tier takes their place, and so is ``kept_host`` where the host part is
            detected: host tiers kept from earlier runs, given back when a new one needs their room.
            On the CPU the host is the device: a stage that streams from ``stream_from`` (the model's
            own files) parks nothing in host RAM (host 0); a pipeline ``loaded`` already keeps what is
            not resident where it is (host unlimited); otherwise the budget's host part.
    disk:   ``stream_from`` where given, else the budget's.
    """
    limit = budget.device
    if limit is not None and already_used:
        if limit <= already_used:
            raise BudgetTooSmall(
                limit, already_used, "this process already holds that before the stage loads any weight: Python, "
                "torch, the libraries memfit loaded and any stage kept loaded", ", or leave it out (auto) to let "
                "memfit detect one", above=True)
        limit -= already_used
    disk = stream_from if stream_from is not None else budget.disk
    if getattr(device, "separate_memory", False):
        host = (budget.host if budget.host is not None else detect(device).budget.host + kept_host) + host_in_use
    elif stream_from is not None:
        host = 0
    elif loaded:
        host = None
    else:
        host = budget.host
    return Budget(device=limit, host=host, disk=disk)


def above_process_size(value: object) -> str | None:
    """The SIZE of a "+SIZE" budget (ABOVE_PROCESS), or None for any other value."""
    if isinstance(value, str) and value.strip().startswith("+"):
        return value.strip()[1:]
    return None


def stage_start_budget(budget: Budget, in_use: int) -> Budget:
    """A "+SIZE" budget as the whole-process budget of a stage that starts with ``in_use`` bytes held, which is
    what stage_budget and the planner take."""
    return dataclasses.replace(budget, device=in_use + budget.device)


def _parse_field(field: str, raw: object) -> int:
    try:
        return parse_size(raw)  # type: ignore[arg-type]
    except MemfitError as exc:
        raise MemfitError(f"Budget {field}: {exc}") from None


# --- detection --------------------------------------------------------------------------------


def host_reserve(total: int) -> int:
    """Host RAM detection leaves unused: 1/8 of ``total`` (the container limit or the machine's
    RAM), at least 64 MiB and at most 2 GiB (600 MiB container: 75 MiB; 24 GiB machine: 2 GiB)."""
    return int(min(DEFAULT_HOST_RESERVE, max(_MIN_HOST_RESERVE, total // 8)))


def device_reserve(total: int) -> int:
    """GPU memory detection leaves unused: 1/16 of the device's total, between 256 MiB and 1 GiB."""
    return int(min(DEFAULT_DEVICE_RESERVE, max(_MIN_DEVICE_RESERVE, total // 16)))


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What /proc/meminfo and this process's memory cgroup say, in bytes.

    cgroup_usage is the cgroup's working set: its usage less the inactive file cache the kernel
    reclaims before it would kill anything (what ``docker stats`` and the kubelet count).
    """

    mem_available: int
    mem_total: int | None = None
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup_dir: str | None = None

    @property
    def cgroup_room(self) -> int | None:
        if self.cgroup_limit is None:
            return None
        return max(0, self.cgroup_limit - (self.cgroup_usage or 0))

    @property
    def available(self) -> int:
        """Bytes of RAM this process could still allocate: min(MemAvailable, cgroup limit - usage)."""
        room = self.cgroup_room
        return self.mem_available if room is None else min(self.mem_available, room)

    @property
    def limited_by_cgroup(self) -> bool:
        room = self.cgroup_room
        return room is not None and room <= self.mem_available

    @property
    def total(self) -> int | None:
        """The most this process could ever use: the cgroup limit, or the machine's RAM."""
        totals = [t for t in (self.cgroup_limit, self.mem_total) if t is not None]
        return min(totals) if totals else None


@dataclasses.dataclass(frozen=True)
class ResolvedBudget:
    """A budget as a run uses it: ``budget`` is None for "none"; ``source`` says where it came from
    in one line for the report and ``memfit plan``; ``mode`` is "auto", "explicit", "none" or ABOVE_PROCESS
    (``budget`` then counts only what a stage adds: stage_start_budget)."""

    budget: Budget | None
    source: str
    mode: str

    def to_dict(self) -> dict:
        return {"mode": self.mode, "source": self.source,
                "budget": None if self.budget is None else self.budget.to_dict()}


def resolve_budget(
    value: "BudgetLike | None",
    device: str | None = None,
    *,
    in_use: int = 0,
    proc_root: str | os.PathLike = "/proc",
    sys_root: str | os.PathLike = "/sys",
) -> ResolvedBudget:
    """Turn what the user passed (``"auto"`` or None, ``"none"``, a size, ``"+SIZE"``, a mapping, a Budget)
    into the budget a run plans with, and say where it came from.

    ``in_use`` is what this process already holds on ``device`` (RSS on the CPU, allocated memory on
    a GPU): a budget bounds the whole process, so detection adds it to the free room it measures.
    An explicit device budget above the container's memory limit, the machine's RAM (CPU) or the
    GPU's total is refused, naming both numbers: the kernel (or CUDA) would stop the run long before
    the plan's peak, so such a plan would only pretend to fit. On a GPU it is also refused above
    what the GPU can give this process now (``mem_get_info``'s free memory + what this process's
    allocator holds already), which names what other processes hold. Apple's GPU (mps) shares host
    RAM: its budgets are checked and detected as the host's.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return detect(device, in_use=in_use, proc_root=proc_root, sys_root=sys_root)
    if isinstance(value, str) and value.strip().lower() == NONE:
        return ResolvedBudget(None, "none: no budget (planning off; every component loads whole)", NONE)
    above = above_process_size(value)
    if above is not None:
        budget = Budget.of(above)
        return ResolvedBudget(budget, f"explicit: device {format_bytes(budget.device)} above what this process holds "
                              "as each stage starts", ABOVE_PROCESS)
    budget = Budget.of(value)
    cuda = _is_cuda(device)
    if budget.device is not None:
        if cuda:
            free, total = _cuda_memory(device)
            _refuse_above(budget.device, total, f"the total memory of {_name(device)}", "device budget")
            _refuse_above_free(budget.device, free, _cuda_held(device), total, _name(device))
        else:
            host = read_host_memory(proc_root=proc_root, sys_root=sys_root)
            _refuse_above(budget.device, *_host_total(host))
    if cuda and budget.host is not None:
        host = read_host_memory(proc_root=proc_root, sys_root=sys_root)
        _refuse_above(budget.host, *_host_total(host), what="host budget")
    parts = [f"device {format_bytes(budget.device)}" if budget.device is not None else "device unlimited"]
    if budget.host is not None:
        parts.append(f"host {format_bytes(budget.host)}")
    if budget.disk is not None:
        parts.append(f"disk {budget.disk}")
    return ResolvedBudget(budget, "explicit: " + ", ".join(parts), "explicit")


def _host_total(host: HostMemory) -> tuple[int | None, str]:
    if host.cgroup_limit is not None and (host.mem_total is None or host.cgroup_limit <= host.mem_total):
        return host.cgroup_limit, f"this container's memory limit (cgroup {host.cgroup_dir})"
    return host.mem_total, "this machine's RAM (MemTotal)"


def _refuse_above(requested: int, limit: int | None, limit_name: str, what: str = "budget") -> None:
    if limit is None or requested <= limit:
        return
    raise MemfitError(
        f"The {what} of {format_bytes(requested)} ({requested} bytes) is above {limit_name}, "
        f"{format_bytes(limit)} ({limit} bytes): the run would be killed before memfit's plan is reached. "
        f"Give at most {format_bytes(limit)}, or leave the budget out (auto) to fit what is free now."
    )


def _refuse_above_free(requested: int, free: int, held: int, total: int, name: str) -> None:
    room = free + held
    if requested <= room:
        return
    others = max(0, total - room)
    raise MemfitError(
        f"The device budget of {format_bytes(requested)} ({requested} bytes) is above what {name} can give this run "
        f"now, {format_bytes(room)} ({format_bytes(free)} free + {format_bytes(held)} this process holds; about "
        f"{format_bytes(others)} is held by other processes or the driver): give at most {room} bytes "
        f"(--budget {room // (1 << 20)}MiB), free the device, or leave the budget out (auto) to fit what is free now."
    )


def detect(
    device: str | None = None,
    *,
    reserve: int | str | None = None,
    in_use: int = 0,
    proc_root: str | os.PathLike = "/proc",
    sys_root: str | os.PathLike = "/sys",
) -> ResolvedBudget:
    """Measure what memfit may use right now: the automatic budget, with the arithmetic that produced it
    (``.budget``, and ``.source`` in words).

    With a CUDA ``device`` ("cuda", "cuda:1"): device = free device memory
    (``torch.cuda.mem_get_info``) + ``in_use`` (at least what this process's allocator holds, its
    cache included) minus ``reserve`` (default ``device_reserve``:
    1/16 of the GPU, 256 MiB to 1 GiB); host = available RAM minus ``host_reserve``. Without one
    (None or "cpu"): device = available RAM + ``in_use`` minus ``reserve`` (default
    ``host_reserve``: 1/8 of the container limit or RAM, 64 MiB to 2 GiB) and host = 0, because on
    the CPU the device *is* host memory, so nothing can be parked separately. Available RAM is the
    smaller of MemAvailable (/proc/meminfo, psutil as a fallback) and the free room under this
    process's cgroup memory limit (v2 and v1 both read).

    ``proc_root`` and ``sys_root`` exist so tests can point at fake /proc and /sys trees.
    """
    host = read_host_memory(proc_root=proc_root, sys_root=sys_root)
    unified = _is_unified(device)
    if _is_cuda(device):
        free, total = _cuda_memory(device)
        # The allocator's cached blocks are this process's to reuse, and mem_get_info counts them as used:
        # what it holds is at least its reserved memory, whatever the caller counted (allocated tensors).
        in_use = max(in_use, _cuda_held(device))
        d_reserve = device_reserve(total) if reserve is None else parse_size(reserve)
        h_reserve = host_reserve(host.total or host.available)
        budget = Budget(device=max(0, in_use + free - d_reserve), host=max(0, host.available - h_reserve))
        source = (f"auto: {_name(device)} free {format_bytes(free)} of {format_bytes(total)}"
                  + (f" + {format_bytes(in_use)} this process holds" if in_use else "")
                  + f" - reserve {format_bytes(d_reserve)} = {format_bytes(budget.device)}; host tier: "
                  + _host_words(host) + f" - reserve {format_bytes(h_reserve)} = {format_bytes(budget.host)}")
        return ResolvedBudget(budget, source, AUTO)
    if device is not None and _name(device) != "cpu" and not unified:
        raise MemfitError(
            f"memfit cannot detect a budget for device {_name(device)!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps', "
            "or pass an explicit budget such as budget=\"6GiB\"."
        )
    h_reserve = host_reserve(host.total or host.available) if reserve is None else parse_size(reserve)
    budget = Budget(device=max(0, in_use + host.available - h_reserve), host=0)
    source = ("auto: " + ("mps shares host RAM (unified memory): " if unified else "") + _host_words(host)
              + (f" + {format_bytes(in_use)} this process holds" if in_use else "")
              + f" - reserve {format_bytes(h_reserve)} = {format_bytes(budget.device)}")
    return ResolvedBudget(budget, source, AUTO)


def _host_words(host: HostMemory) -> str:
    if host.limited_by_cgroup:
        return (f"cgroup limit {format_bytes(host.cgroup_limit)} - {format_bytes(host.cgroup_usage or 0)} in use "
                f"= {format_bytes(host.cgroup_room)} free")
    total = f" of {format_bytes(host.mem_total)}" if host.mem_total is not None else ""
    return f"MemAvailable {format_bytes(host.mem_available)}{total}"


def _is_cuda(device) -> bool:
    """Whether ``device`` (a name or a memfit.devices.DeviceRuntime) has memory of its own to measure."""
    if device is None or _is_unified(device):
        return False
    if isinstance(device, str):
        return device.startswith("cuda")
    return bool(getattr(device, "separate_memory", False))


def _is_unified(device) -> bool:
    """Whether ``device`` is Apple's GPU (mps), whose memory is the host's RAM."""
    return device is not None and _name(device).startswith("mps")


def _name(device) -> str:
    return str(getattr(device, "name", device))


def _cuda_memory(device) -> tuple[int, int]:
    from memfit.devices import runtime_for  # local: budget parsing must not pay for importing torch

    return runtime_for(device).mem_get_info()


def _cuda_held(device) -> int:
    """Device memory this process's allocator holds (reserved: live tensors and its cache, which a run
    reuses); ``mem_get_info`` counts it as used."""
    from memfit.devices import runtime_for

    return runtime_for(device).memory_reserved()


def available_host_memory(
    *, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"
) -> int:
    """Bytes of RAM this process could still allocate: min(MemAvailable, cgroup limit - usage)."""
    return read_host_memory(proc_root=proc_root, sys_root=sys_root).available


def read_host_memory(
    *, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"
) -> HostMemory:
    """MemAvailable, MemTotal and this process's cgroup limit and working set, read now."""
    available, total = _meminfo(Path(proc_root))
    limit = _own_cgroup_limit(proc_root=proc_root, sys_root=sys_root)
    if limit is None:
        return HostMemory(available, total)
    directory, limit_bytes, usage, _ = limit
    return HostMemory(available, total, limit_bytes, usage, str(directory))


def _meminfo(proc: Path) -> tuple[int, int | None]:
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # the kernel always writes "kB" here and means KiB
    if "MemAvailable" in fields:
        return fields["MemAvailable"], fields.get("MemTotal")
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        raise MemfitError(
            f"Cannot find MemAvailable in {proc / 'meminfo'} and psutil is not installed; "
            "pass an explicit budget such as budget=\"6GiB\"."
        ) from None
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def cgroup_free_memory(
    *, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"
) -> int | None:
    """Room left under this process's cgroup memory limit, or None when there is no limit.

    Reads /proc/self/cgroup to find our own cgroup (containers often nest it), then cgroup v2
    ``memory.max`` / ``memory.current`` or cgroup v1 ``memory.limit_in_bytes`` /
    ``memory.usage_in_bytes`` under /sys/fs/cgroup, less the inactive file cache of ``memory.stat``.
    """
    return read_host_memory(proc_root=proc_root, sys_root=sys_root).cgroup_room


class CgroupUsage(NamedTuple):
    """This process's memory cgroup now: its working set (usage less the inactive file cache), its limit, and the
    active file cache inside that working set (pages of files, mapped weights among them, the kernel can still drop
    and read again: a run near its limit through them slows down but is not killed)."""

    working_set: int
    limit: int
    active_file: int = 0


def own_cgroup_usage(
    *, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"
) -> CgroupUsage | None:
    """This process's memory cgroup's usage now, or None without a limit."""
    found = _own_cgroup_limit(proc_root=proc_root, sys_root=sys_root)
    return None if found is None else CgroupUsage(found[2], found[1], found[3])


def _own_cgroup_limit(*, proc_root, sys_root) -> tuple[Path, int, int, int] | None:
    """(cgroup directory, limit, working set, active file cache) of this process's memory cgroup."""
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
            found = _cgroup_limit(cgroup_fs / relative, "memory.max", "memory.current", "")
        elif "memory" in controllers.split(","):
            found = _cgroup_limit(cgroup_fs / "memory" / relative, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                  "total_")
        else:
            continue
        if found is not None:
            return found
    return None


def _cgroup_limit(directory: Path, limit_file: str, usage_file: str,
                  stat_prefix: str) -> tuple[Path, int, int, int] | None:
    """``stat_prefix``: "total_" on cgroup v1, whose memory.stat counts the hierarchy's pages under those names."""
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
    stat = {}
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in (stat_prefix + "inactive_file", stat_prefix + "active_file"):
                stat[key] = int(value)
    except (OSError, ValueError):
        pass
    working_set = max(0, usage - stat.get(stat_prefix + "inactive_file", 0))
    return directory, limit, working_set, min(working_set, stat.get(stat_prefix + "active_file", 0))
