"""A batch's output folder: ``<id>.png`` written atomically, ``results.jsonl`` appended one whole line per job.

Crash safety, in order: a job's PNG is renamed into place (memfit.atomic) before its line is
appended, and a line is appended with one write and flushed to disk. So a driver killed at any
moment leaves, per job, nothing, a complete PNG without a line (the job runs again and the PNG is
replaced by the same one), or both. A line cut short by the kill has no newline; it is cut off when
the batch resumes. Only one driver writes a folder at a time (an flock on ``.memfit-batch.lock``),
and the temporary files of writes it interrupted are removed when the next one starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from memfit.atomic import remove_stale_temporaries, write_atomically
from memfit.batch.jobs import Job
from memfit.errors import MemfitError

try:
    import fcntl
except ImportError:  # Windows: no lock, the rest holds
    fcntl = None  # type: ignore[assignment]

__all__ = ["BatchOutput", "JobOutput", "RESULTS"]

RESULTS = "results.jsonl"
LOCK = ".memfit-batch.lock"


@dataclass
class JobOutput:
    """What a worker returns for one job: the PNG's bytes (with memfit generate's metadata) or the failure."""

    id: str
    key: str
    worker: str
    seconds: float
    png: bytes | None = None
    seed: int | None = None
    peak_bytes: int | None = None
    error: str | None = None
    threads: int | None = None  # the threads torch computed with (memfit.run.threads)

    @property
    def ok(self) -> bool:
        return self.error is None


class BatchOutput:
    """The output folder of one batch, locked for this driver while open (use as a context manager)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.results = self.folder / RESULTS
        self._lock_fd: int | None = None
        self.repaired = ""

    def __enter__(self) -> "BatchOutput":
        if self.folder.exists() and not self.folder.is_dir():
            raise MemfitError(f"--out {self.folder} is a file; give a folder for the images and results.jsonl.")
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise MemfitError(f"Another memfit batch is writing to {self.folder}; wait for it to finish "
                                  "or give another --out.") from None
        self._lock_fd = fd
        remove_stale_temporaries(self.folder)  # writes a killed driver left unfinished (only memfit's own)
        self._repair()
        return self

    def __exit__(self, *exc) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _repair(self) -> None:
        """Cut off a last line without its newline: the half-written line of a killed driver."""
        if not self.results.is_file():
            return
        data = self.results.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with open(self.results, "r+b") as handle:
                handle.truncate(keep)
            self.repaired = f"cut off an unfinished last line of {self.results} ({len(data) - keep} bytes)"

    def finished(self) -> dict[str, dict]:
        """id -> the latest result line for it (a later line for an id replaces an earlier one)."""
        done: dict[str, dict] = {}
        if not self.results.is_file():
            return done
        for number, raw in enumerate(self.results.read_text(encoding="utf-8").splitlines(), start=1):
            try:
                record = json.loads(raw)
                done[str(record["id"])] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MemfitError(f"{self.results} line {number} is not a memfit result; remove that line "
                                  "(its job will run again) and resume.") from None
        return done

    def is_done(self, job: Job, record: dict | None, retry_failed: bool) -> bool:
        """Whether ``job`` needs no run: its latest line has the same content key and its image is there."""
        if record is None or record.get("key") != job.key:
            return False
        if record.get("status") == "failed":
            return not retry_failed
        return (self.folder / record.get("file", "")).is_file()

    def image_path(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.png"

    def record(self, job: Job, output: JobOutput, attempts: int = 1) -> dict:
        """Write the job's PNG (if it succeeded), then append its line; returns the line's record."""
        line = {"id": job.id, "key": job.key, "status": "ok" if output.ok else "failed", "line": job.line}
        if output.ok:
            path = self.image_path(job.id)
            write_atomically(path, lambda tmp: Path(tmp).write_bytes(output.png))
            line.update(file=path.name, seed=output.seed)
        else:
            line.update(file=None, seed=job.seed, error=output.error)
        line.update(seconds=round(output.seconds, 3), worker=output.worker, peak_bytes=output.peak_bytes,
                    threads=output.threads, attempts=attempts)
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(self.results, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write of the whole line
            os.fsync(fd)
        finally:
            os.close(fd)
        return line
