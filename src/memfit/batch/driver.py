"""memfit batch: read and check the jobs, skip what a previous run finished, run the rest, record each.

The driver is the only writer of the output folder (memfit.batch.output). Local mode runs every
job in this process through one BatchWorker (the pipeline loaded and planned once); Ray mode
(memfit.batch.ray_pool) streams them to one worker actor per GPU or per stated CPUs. Both give a
job that failed for a reason of its own one more try on a fresh load, then record it as failed
and go on.
"""

from __future__ import annotations

import sys
import time

from memfit.batch.jobs import BadLine, Job, read_jobs
from memfit.batch.output import BatchOutput
from memfit.batch.recording import ATTEMPTS, BatchOptions, BatchSummary, Progress, record
from memfit.errors import MemfitError

__all__ = ["check_jobs", "run_batch", "still_to_run"]


def check_jobs(jobs_path, options: BatchOptions, summary: BatchSummary) -> list[Job]:
    """The good jobs. Bad lines (unreadable, or settings the model refuses) are refused under
    ``strict`` before anything runs or is written, else reported and skipped. A checkpoint memfit
    refuses (pickle without allow_pickle, a truncated file) refuses the whole batch, here."""
    from memfit.models.families import Conditioning
    from memfit.plan.stages import planned_models
    from memfit.run.generate import check_conditioning
    from memfit.run.stages import open_model

    folder = open_model(options.model, allow_pickle=options.allow_pickle, config=options.config,
                        components=options.components, quantize=options.quantize)
    folder.check_weights(planned_models(folder.adapter))
    jobs, bad = read_jobs(jobs_path, options.defaults, model=lambda: folder.fingerprint, dtype=options.dtype)
    checked = []
    for job in jobs:
        try:  # the family's own checks (size multiple, a setting it does not take) before any weight loads
            folder.adapter.resolve(job.prompt, job.negative_prompt, job.steps, job.guidance, job.seed, job.width,
                                   job.height, folder.defaults)
            check_conditioning(folder.adapter, Conditioning(loras=job.loras), False)
        except MemfitError as exc:
            bad.append(BadLine(job.line, f"job {job.id!r}: {str(exc).rstrip('.')}"))
            continue
        checked.append(job)
    bad.sort(key=lambda b: b.line)
    summary.total = len(checked) + len(bad)
    summary.bad = bad
    if bad and options.strict:
        shown = "; ".join(map(str, bad[:10])) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise MemfitError(f"{jobs_path} has {len(bad)} bad line(s), nothing was run (--strict): {shown}.")
    for line in bad:
        print(f"memfit batch: {jobs_path} {line}; skipped", file=sys.stderr)
    return checked


def still_to_run(jobs: list[Job], options: BatchOptions, output: BatchOutput, summary: BatchSummary) -> list[Job]:
    """The jobs an earlier run of this batch did not finish (same id, same content, image present)."""
    finished = output.finished()
    todo = [job for job in jobs if not output.is_done(job, finished.get(job.id), options.retry_failed)]
    summary.skipped = len(jobs) - len(todo)
    return todo


def run_batch(jobs_path, options: BatchOptions, *, ray: str | None = None, workers: int | None = None,
              cpus_per_worker: float = 1.0, on_result=None) -> BatchSummary:
    """Run the jobs of ``jobs_path`` not yet finished in ``options.out``; ``ray`` is None (this process),
    "local" (start a Ray cluster here) or an address of a running one. ``on_result(pool, line)`` is
    called after each recorded job (tests use it to kill a worker mid-batch)."""
    summary = BatchSummary()
    if ray is None and workers not in (None, 1):
        raise MemfitError("--workers needs --ray: local mode runs one worker in this process.")
    jobs = check_jobs(jobs_path, options, summary)
    with BatchOutput(options.out) as output:
        if output.repaired:
            print(f"memfit batch: {output.repaired}", file=sys.stderr)
        todo = still_to_run(jobs, options, output, summary)
        started = time.perf_counter()
        progress = Progress(len(todo), options.progress)
        try:
            if not todo:
                pass
            elif ray is None:
                _run_local(todo, options, output, summary, progress, on_result)
            else:
                from memfit.batch.ray_pool import run_on_ray

                run_on_ray(todo, options, output, summary, progress, address=ray, workers=workers,
                           cpus_per_worker=cpus_per_worker, on_result=on_result)
        finally:
            progress.close()
            summary.seconds = time.perf_counter() - started
    return summary


def _run_local(todo: list[Job], options: BatchOptions, output: BatchOutput, summary: BatchSummary,
               progress: Progress, on_result) -> None:
    from memfit.batch.worker import BatchWorker
    worker = BatchWorker(options.model, name="local", **options.worker_kwargs())
    summary.workers.append(worker.describe())
    run = worker.run
    for job in todo:
        result = run(job)
        attempts = 1
        while not result.ok and attempts < ATTEMPTS:
            attempts += 1
            result = run(job, fresh=True)
        line = record(output, summary, progress, job, result, attempts)
        if on_result is not None:
            on_result(worker, line)
