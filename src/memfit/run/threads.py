"""How many threads torch computes with during a run, and why.

torch starts with one thread per core the machine has (or OMP_NUM_THREADS). Its OpenMP threads wait
for each other, spinning, at the end of every operation, so a thread that has to share its core
with another process holds all of them up: on 2 cores shared with other work the demo model's
denoising took 15.7 s with torch's 2 threads against 0.95 s with one (docs/threads_demo.md). So unless
the caller names a count (``--threads N``, ``threads=N``), a run computes with:

1. OMP_NUM_THREADS, where it is set: the user's own choice, or Ray's (it sets it in each worker to
   the CPUs the worker reserved, rounded down: workers sharing a machine split it as they reserved it);
2. else the CPUs this process may run on (its affinity: taskset, a cpuset), no more than its
   cgroup's CPU quota allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
   the smallest on the way up from the process's own cgroup), rounded down, at least 1;
3. less the CPUs other processes kept busy just before the run (/proc/stat over those CPUs, less
   this process's own time; a CPU counts as busy from a fifth of it on), at least 1.

The count is set with torch.set_num_threads for the run and torch's count before it is put back
when the run ends, so a caller's own setting outlives memfit.generate. torch's inter-op threads are
left alone: diffusers' pipelines run one operation at a time.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["MAX_THREADS", "ThreadCount", "busy_cpus_of_others", "check_threads", "choose_threads", "cpu_quota",
           "start_looking_at_cpus", "torch_threads", "usable_cpus"]

MAX_THREADS = 1024  # more than any machine memfit runs on has cores: a larger count is a typo
# Others' use of a CPU below this fraction leaves it free to compute on (background daemons, a shell).
_BUSY_FROM = 0.2
# The shortest look at /proc/stat that tells a busy CPU from an idle one (its counters tick 100 times a
# second), and how long an earlier look stays good as the start of the next one (a Session's runs follow
# each other: the next run then measures what others did during the last one, with no wait).
_SAMPLE_SECONDS = 0.1
_SAMPLE_GOOD_FOR = 30.0


@dataclass(frozen=True)
class ThreadCount:
    """The threads a run computes with and where that number came from, in words (the report's line)."""

    count: int
    source: str

    def to_dict(self) -> dict:
        return {"count": self.count, "source": self.source}


def check_threads(value) -> int | None:
    """``--threads`` / ``threads=`` as a count: a whole number from 1 to MAX_THREADS, or None (memfit picks)."""
    if value is None:
        return None
    count = _whole_number(value)
    if count is None:
        raise MemfitError(f"--threads {value} is not a whole number; give a count of threads such as 1 or 4, or "
                          "leave it out to use the CPUs this process may use.")
    if count < 1:
        raise MemfitError(f"--threads {value}: give at least 1 thread, or leave it out to use the CPUs this process "
                          "may use.")
    if count > MAX_THREADS:
        raise MemfitError(f"--threads {value} is more than memfit takes ({MAX_THREADS}); give at most the CPUs this "
                          "machine has, or leave it out.")
    return count


def _whole_number(value) -> int | None:
    """``value`` as an int if it is one or its text is; None otherwise (True is an int to Python and 2.0 a
    float: neither is a count anyone wrote)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
    return None


def cpu_quota(*, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys") -> float | None:
    """CPUs' worth of time this process's cgroups allow it (quota / period), or None where nothing limits it.

    The smallest quota on the way from the process's own cgroup up to the root counts: a container's
    limit usually sits on a cgroup above the one the process is in.
    """
    proc, cgroup_fs = Path(proc_root), Path(sys_root) / "fs" / "cgroup"
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        # "hierarchy-id:controllers:path"; cgroup v2 is the single "0::/path" line.
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            quotas += [_v2_quota(directory) for directory in _up_from(cgroup_fs, path)]
        elif "cpu" in controllers.split(","):
            for mount in (cgroup_fs / controllers, cgroup_fs / "cpu"):
                quotas += [_v1_quota(directory) for directory in _up_from(mount, path)]
    quotas = [quota for quota in quotas if quota is not None]
    return min(quotas) if quotas else None


def _up_from(mount: Path, path: str) -> list[Path]:
    """The cgroup folders from ``path`` (as /proc/self/cgroup names it) up to ``mount``; in a container that
    names a host path the mount does not have, only the mount (its own root) is there."""
    parts = [part for part in path.strip().split("/") if part]
    folders = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if folder.is_dir()]


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100_000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period  # -1: no quota


def usable_cpus(*, affinity: set[int] | None = None, proc_root: str | os.PathLike = "/proc",
                sys_root: str | os.PathLike = "/sys") -> tuple[int, str]:
    """(CPUs this process may compute on, in words why): its affinity, limited by its cgroup's CPU quota,
    rounded down, at least 1. ``affinity`` defaults to the process's own (all CPUs where the platform
    cannot say)."""
    machine = os.cpu_count() or 1
    affinity = _own_affinity() if affinity is None else affinity
    allowed = max(1, len(affinity))
    quota = cpu_quota(proc_root=proc_root, sys_root=sys_root)
    if quota is not None and quota < allowed:
        count = max(1, math.floor(quota))
        return count, f"CPU quota {quota:g} of {allowed} CPU{'s' if allowed > 1 else ''}"
    if allowed < machine:
        return allowed, f"affinity {allowed} of {machine} CPUs"
    return allowed, f"{allowed} CPU{'s' if allowed > 1 else ''}"


def _own_affinity() -> set[int]:
    """The CPUs this process may run on (every CPU where the platform cannot say: macOS, Windows)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class _CpuSample:
    at: float  # time.monotonic()
    busy_ticks: dict[int, int]  # per CPU: ticks spent on anything but idle and I/O wait
    own_seconds: float  # this process's CPU time, all its threads


_last_sample: _CpuSample | None = None


def _sample(proc_root: Path) -> _CpuSample | None:
    try:
        lines = (proc_root / "stat").read_text().splitlines()
    except OSError:
        return None
    busy = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and len(fields) >= 5:
            ticks = [int(field) for field in fields[:8]]
            busy[int(name[3:])] = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    times = os.times()
    return _CpuSample(time.monotonic(), busy, times.user + times.system)


def busy_cpus_of_others(cpus: set[int], *, proc_root: str | os.PathLike = "/proc") -> float | None:
    """CPUs' worth of time other processes used on ``cpus`` lately, or None where /proc/stat cannot say.

    Measured since the last look (start_looking_at_cpus, or the last call) when that began at most 30 s ago:
    during a Session's previous run, or while this run opened its model; else from now. A look shorter
    than 0.1 s is waited out to 0.1 s. This process's own time is taken off.
    """
    global _last_sample
    proc = Path(proc_root)
    now = time.monotonic()
    start = _last_sample
    if start is None or now - start.at > _SAMPLE_GOOD_FOR:
        start = _sample(proc)
        if start is None:
            return None
    if time.monotonic() - start.at < _SAMPLE_SECONDS:  # a look begun as the run began: only the rest of it
        time.sleep(_SAMPLE_SECONDS - (time.monotonic() - start.at))
    end = _sample(proc)
    if end is None:
        return None
    _last_sample = end
    ticks_per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = sum(end.busy_ticks.get(cpu, 0) - start.busy_ticks.get(cpu, 0) for cpu in cpus) / ticks_per_second
    others = busy - (end.own_seconds - start.own_seconds)
    return max(0.0, others / max(end.at - start.at, 1e-3))


def start_looking_at_cpus(*, proc_root: str | os.PathLike = "/proc") -> None:
    """Start the next look at /proc/stat now. At the end of a run: the next run measures others' use from there.
    As a run begins (before its model is opened): the look then takes no time of its own."""
    global _last_sample
    _last_sample = _sample(Path(proc_root)) or _last_sample


def choose_threads(asked: int | None = None, *, environ=None, affinity: set[int] | None = None,
                   proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys") -> ThreadCount:
    """The threads a run computes with (the module's docstring gives the rule)."""
    if asked is not None:
        return ThreadCount(asked, "asked for")
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(environ["OMP_NUM_THREADS"]) >= 1:
        return ThreadCount(int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS")
    affinity = _own_affinity() if affinity is None else affinity
    count, why = usable_cpus(affinity=affinity, proc_root=proc_root, sys_root=sys_root)
    if count == 1:
        return ThreadCount(1, why)
    others = busy_cpus_of_others(affinity, proc_root=proc_root)
    if others is None or others < _BUSY_FROM:
        return ThreadCount(count, why)
    free = max(1, min(count, math.floor(len(affinity) - others + _BUSY_FROM)))
    return ThreadCount(free, f"{why}, {others:.1f} of them busy with other processes")


@contextlib.contextmanager
def torch_threads(count: int):
    """torch computes with ``count`` threads inside the block; its count before is put back after, and the next
    look at /proc/stat starts there (the next run measures what others did from the end of this one)."""
    import torch

    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
        start_looking_at_cpus()
