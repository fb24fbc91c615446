"""Run a command under a memory cap: the proof that a run fits (cgroup v1 memory controller).

A child of this process's own memory cgroup gets `memory.limit_in_bytes` (and the same
`memory.memsw.limit_in_bytes` where swap accounting exists, so the cap cannot be dodged by
swapping). Page cache counts against the cap, so a memory-mapped model that merely re-reads from
disk is measured honestly. The cgroup is removed afterwards, whatever happens.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup/memory")


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory, or None."""
    return _own_memory_cgroup()


def _own_memory_cgroup() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return _ROOT / path.lstrip("/")
    except OSError:
        return None
    return None


def cgroup_unavailable_reason() -> str | None:
    """None when capped runs are possible here, else why not (for skips and reports)."""
    own = _own_memory_cgroup()
    if own is None or not own.is_dir():
        return "no cgroup v1 memory controller for this process (/sys/fs/cgroup/memory)"
    probe = own / f"memfit-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(1 << 30))
    except OSError as exc:
        return f"cannot create a child memory cgroup under {own}: {exc.strerror}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


@dataclass
class CappedRun:
    returncode: int
    killed: bool  # by the out-of-memory killer of the cgroup
    seconds: float
    max_usage_bytes: int  # memory.max_usage_in_bytes: RSS + page cache charged to the run
    stdout: str
    stderr: str

    @property
    def completed(self) -> bool:
        return self.returncode == 0 and not self.killed


def run_capped(command: list[str], limit_bytes: int | None, *, timeout: float = 900, env=None) -> CappedRun:
    """Run `command` in a fresh child memory cgroup limited to `limit_bytes` (None: no limit)."""
    reason = cgroup_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    group = _own_memory_cgroup() / f"memfit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        if limit_bytes is not None:
            (group / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
            memsw = group / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(int(limit_bytes)))
        procs = str(group / "cgroup.procs")

        def enter_group():  # runs in the child between fork and exec
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))

        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=enter_group)
        seconds = time.perf_counter() - started
        oom_kills = 0
        for line in (group / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                oom_kills = int(line.split()[1])
        killed = oom_kills > 0 or result.returncode == -9
        max_usage = int((group / "memory.max_usage_in_bytes").read_text())
        return CappedRun(result.returncode, killed, seconds, max_usage, result.stdout, result.stderr)
    finally:
        _remove(group)


def evict_page_cache(target: str | Path) -> None:
    """Drop the page cache of `target`, a file or every file under a folder, so the next run reads (and
    is charged for) them afresh instead of finding them cached and charged to whoever read them first."""
    target = Path(target)
    for path in [target] if target.is_file() else target.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _remove(group: Path) -> None:
    # A cgroup can only be removed once empty; its processes have exited by now, but the kernel
    # may take a moment to notice.
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
