"""One batch worker: the model folder opened once, its stages loaded, planned and compiled once
(a memfit.run.session.Session, as memfit serve's), then one job after another through it.

The same class runs in the local driver's process and, as a Ray actor, on any node of a cluster:
it returns each image as PNG bytes with the metadata ``memfit generate`` writes, and the driver
writes the files, so workers need no shared folder with the driver.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

from memfit.batch.jobs import Job
from memfit.batch.output import JobOutput
from memfit.errors import MemfitError

__all__ = ["BatchWorker"]


class BatchWorker:
    """Runs jobs for one model under one set of run options; keeps the pipeline warm between them."""

    def __init__(self, model, *, dtype: str = "fp32", device=None, budget="auto", backend=None,
                 fallback: str | None = None, allow_pickle: bool = False, config=None, components=None,
                 quantize=None, threads: int | None = None, name: str | None = None):
        import torch

        from memfit.run.options import default_device
        from memfit.run.session import Session

        device = torch.device(device) if device is not None else default_device()
        # "auto" is resolved by each run on this worker's own machine (memfit.plan.budget).
        self.session = Session(model, dtype=dtype, device=device, budget=budget, backend=backend, fallback=fallback,
                               allow_pickle=allow_pickle, config=config, components=components, quantize=quantize,
                               threads=threads)
        self.name = f"{name + '@' if name else ''}{socket.gethostname()}:{os.getpid()}"

    def describe(self) -> dict:
        """Where this worker runs and what it planned with (for the driver's log)."""
        return {"worker": self.name, "device": str(self.session.device), "budget": self.session.budget}

    def run(self, job: Job | dict, *, fresh: bool = False) -> JobOutput:
        """Run one job; a failure of the job itself comes back as a JobOutput with its message.

        ``fresh`` releases the warm stages first (a retry starts from a clean load).
        """
        from memfit.run.media import png_bytes

        if isinstance(job, dict):
            job = Job.from_dict(job)
        if fresh:
            self.session.close()
        started = time.perf_counter()
        try:
            result = self.session.generate(job.prompt, **job.arguments())
            png = png_bytes(result.images[0], result.metadata)
        except MemfitError as exc:
            return JobOutput(job.id, job.key, self.name, time.perf_counter() - started, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a job's own failure must not stop the batch
            last = traceback.extract_tb(exc.__traceback__)[-1:]
            where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
            return JobOutput(job.id, job.key, self.name, time.perf_counter() - started,
                             error=f"{type(exc).__name__}: {exc}{where}")
        return JobOutput(job.id, job.key, self.name, time.perf_counter() - started, png=png,
                         seed=result.settings.seed, peak_bytes=result.report.peak_bytes,
                         threads=result.report.threads.get("count"))
