"""What the local and the Ray driver of memfit batch share: the options, the summary, the progress
bar over the whole batch, and recording a finished job (memfit.batch.output writes it)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from memfit.batch.jobs import BadLine, Job, JobDefaults
from memfit.batch.output import BatchOutput, JobOutput

__all__ = ["ATTEMPTS", "BatchOptions", "BatchSummary", "Progress", "record"]

ATTEMPTS = 2  # a job that fails this many times for a reason of its own is recorded as failed


@dataclass
class BatchOptions:
    model: str | Path | None
    out: str | Path
    dtype: str = "fp32"
    device: str | None = None
    budget: object = "auto"
    backend: object = None
    fallback: str | None = None
    defaults: JobDefaults = field(default_factory=JobDefaults)
    strict: bool = False
    retry_failed: bool = False
    progress: bool = True
    allow_pickle: bool = False
    config: str | Path | None = None  # a checkpoint file's configs (memfit.generate's config)
    components: dict | None = None  # components replaced by files (memfit.generate's components)
    quantize: dict | None = None  # components quantized on the fly (memfit.generate's quantize)
    threads: int | None = None  # torch's threads in each worker (None: memfit.run.threads picks)

    def worker_kwargs(self) -> dict:
        return {"dtype": self.dtype, "device": self.device, "budget": self.budget, "backend": self.backend,
                "fallback": self.fallback, "allow_pickle": self.allow_pickle, "config": self.config,
                "components": self.components, "quantize": self.quantize, "threads": self.threads}


@dataclass
class BatchSummary:
    total: int = 0
    skipped: int = 0  # finished by an earlier run
    done: int = 0
    failed: int = 0
    bad: list[BadLine] = field(default_factory=list)
    seconds: float = 0.0
    requeued: int = 0  # jobs lost with a worker and run again elsewhere (Ray mode)
    workers: list[dict] = field(default_factory=list)

    @property
    def images_per_minute(self) -> float:
        return 60.0 * self.done / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        text = (f"{self.done} done, {self.failed} failed, {self.skipped} already done, {len(self.bad)} bad lines "
                f"skipped, of {self.total} jobs; {self.images_per_minute:.1f} images/min")
        return text + (f"; {self.requeued} run again after their worker was lost" if self.requeued else "")


class Progress:
    """A bar over the whole batch with images/min and the time left."""

    def __init__(self, total: int, enabled: bool):
        self.started = time.perf_counter()
        self.count = 0
        self.bar = None
        if enabled and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="batch", unit="img", dynamic_ncols=True,
                            bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}, ETA {remaining}")
            self.bar.set_postfix_str("-- images/min")

    def advance(self) -> None:
        self.count += 1
        if self.bar is not None:
            rate = 60.0 * self.count / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{rate:.1f} images/min", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def record(output: BatchOutput, summary: BatchSummary, progress: Progress, job: Job, result: JobOutput,
           attempts: int) -> dict:
    line = output.record(job, result, attempts)
    if result.ok:
        summary.done += 1
    else:
        summary.failed += 1
        if progress.bar is not None:
            progress.bar.write(f"memfit batch: job {job.id!r} (line {job.line}) failed {attempts} times: {result.error}")
        else:
            print(f"memfit batch: job {job.id!r} (line {job.line}) failed {attempts} times: {result.error}",
                  file=sys.stderr)
    progress.advance()
    return line
