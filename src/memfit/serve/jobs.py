"""The server's queue: one generation at a time (memory is the constraint), first in, first out.

A Job is one HTTP request's work: one image per seed, each a Session.generate run. One worker thread
takes jobs in order. A job leaves the queue when it is done, when its client cancels it (an
interrupt, or a client that went away: a waiting job is dropped, a running one stops at its next
cancellation point: the start of an image, of a stage, or a denoising step), or when the server
stops (waiting jobs are cancelled; the running one gets a grace period to finish, then is stopped
at its next cancellation point).
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.run.session import Interrupted, Session
from memfit.run.media import png_bytes

__all__ = ["Job", "JobQueue"]

FINISHED = ("done", "interrupted", "cancelled", "failed")


@dataclass
class Job:
    """One request: ``runs`` is a list of Session.generate keyword arguments (prompt included), one per image."""

    runs: list[dict[str, Any]]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    state: str = "queued"  # queued, running, then one of FINISHED
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    images: list[bytes] = field(default_factory=list)
    reports: list[dict] = field(default_factory=list)
    error: str = ""
    error_is_input: bool = False  # a MemfitError: the request was wrong (422), not the server (500)
    image_index: int = 0
    step: int = 0
    steps: int = 0
    stop_requested: bool = False
    # Of the last denoising loop, measured by on_step: its first step left out where there are others (it
    # pays for what the kernels set up on their first call at a size).
    seconds_per_step: float | None = None
    # Called with the first image's seconds per step from its second step on, while steps remain: raising
    # MemfitError there ends the job as a refusal (one that would take too long, from its own pace).
    check_pace: Callable[[float], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _loop_marks: list[float] = field(default_factory=list, repr=False)  # when the loop started and its first step ended

    @property
    def progress(self) -> float:
        """0..1 over all of this job's images, counted by denoising steps."""
        if self.state in FINISHED:
            return 1.0
        if not self.runs or self.steps == 0:
            return 0.0
        return min(1.0, (self.image_index + self.step / self.steps) / len(self.runs))

    def eta(self) -> float:
        """Seconds left, from the time per step so far (A1111's eta_relative)."""
        if self.started is None or self.progress <= 0:
            return 0.0
        elapsed = time.time() - self.started
        return max(0.0, elapsed / self.progress - elapsed)

    def on_step(self, stage: str, done: int, total: int) -> None:
        """Session.generate's on_step: (stage, 0, 0) as a stage starts, (stage, done, total) as its loop advances."""
        if total:
            self.step, self.steps = done, total
        if stage == "denoise" and total:
            now = time.perf_counter()
            if done <= 1:
                self._loop_marks[done:] = [now]
            if done >= 1 and len(self._loop_marks) == 2:
                start, first = self._loop_marks
                self.seconds_per_step = now - start if done == 1 else (now - first) / (done - 1)
                if self.check_pace is not None and self.image_index == 0 and 2 <= done < total:
                    self.check_pace(self.seconds_per_step)
        if self.stop_requested:
            where = f"step {done} of {total}" if total else f"the start of the {stage} stage"
            raise Interrupted(f"job {self.id} interrupted at {where}")


class JobQueue:
    """FIFO of Jobs run one at a time on ``session`` by one worker thread."""

    def __init__(self, session: Session, *, keep_finished: int = 100):
        self.session = session
        self.keep_finished = keep_finished
        self._waiting: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}  # every job still known, for progress and reports
        self.running: Job | None = None
        self._cv = threading.Condition()
        self._accepting = True
        self._worker = threading.Thread(target=self._work, name="memfit-serve-worker", daemon=True)
        self._worker.start()

    # ---- clients ---------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        with self._cv:
            if not self._accepting:
                raise MemfitError("The server is shutting down and takes no new requests.")
            self._waiting.append(job)
            self._jobs[job.id] = job
            self._forget_old()
            self._cv.notify_all()
        return job

    def cancel(self, job: Job, reason: str = "") -> None:
        """Drop a waiting job (``reason``: why, for its answer), or stop a running one at its next cancellation point."""
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self._finish(job, "cancelled", reason)
            elif job.state == "running":
                job.stop_requested = True

    def interrupt(self) -> Job | None:
        """Stop the running job (A1111's /interrupt); returns it, or None when nothing runs."""
        with self._cv:
            job = self.running
            if job is not None:
                job.stop_requested = True
            return job

    def get(self, job_id: str) -> Job | None:
        with self._cv:
            return self._jobs.get(job_id)

    def position(self, job: Job) -> int | None:
        """0 while running, 1.. while waiting (1 = next), None once finished."""
        with self._cv:
            if job.state == "running":
                return 0
            try:
                return list(self._waiting).index(job) + 1
            except ValueError:
                return None

    def waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def stop(self, timeout: float | None = None, *, grace: float | None = None) -> bool:
        """Take no new jobs, cancel the waiting ones, let the running one finish (within ``grace`` seconds, as
        ``close``), end the worker; returns whether it ended within ``timeout`` seconds."""
        self.close(grace)
        self._worker.join(timeout)
        return not self._worker.is_alive()

    def close(self, grace: float | None = None) -> int:
        """Take no new jobs and cancel the waiting ones (their clients get an answer at once); returns how many.
        The running job goes on; with ``grace`` it is interrupted after that many seconds, at its next
        cancellation point. Does not block: safe from a signal handler."""
        with self._cv:
            self._accepting = False
            cancelled = len(self._waiting)
            while self._waiting:
                self._finish(self._waiting.popleft(), "cancelled", "The server stopped before this request ran.")
            self._cv.notify_all()
            running = self.running
        if grace is not None and running is not None:
            timer = threading.Timer(grace, self.cancel, (running,))
            timer.daemon = True
            timer.start()
        return cancelled

    # ---- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and self._accepting:
                    self._cv.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                job.state, job.started = "running", time.time()
                self.running = job
            try:
                self._run(job)
            finally:
                with self._cv:
                    self.running = None

    def _run(self, job: Job) -> None:
        state, error = "done", ""
        try:
            for index, settings in enumerate(job.runs):
                job.image_index, job.step = index, 0
                if job.stop_requested:
                    state = "interrupted"
                    break
                generation = self.session.generate(on_step=job.on_step, **settings)
                picture = generation.images[0] if generation.images else generation.frames[0]  # a video's one frame
                job.images.append(png_bytes(picture, generation.metadata))
                job.reports.append(generation.report.to_dict())
        except Interrupted:
            state = "interrupted"
        except MemfitError as exc:
            state, error, job.error_is_input = "failed", str(exc), True
        except Exception as exc:  # the server must outlive a failed run; the client gets the reason
            state, error = "failed", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        with self._cv:
            self._finish(job, state, error)

    def _finish(self, job: Job, state: str, error: str = "") -> None:
        job.state, job.error, job.finished = state, error, time.time()
        job.done.set()

    def _forget_old(self) -> None:
        finished = [job for job in self._jobs.values() if job.state in FINISHED]
        for job in finished[:max(0, len(finished) - self.keep_finished)]:
            del self._jobs[job.id]
