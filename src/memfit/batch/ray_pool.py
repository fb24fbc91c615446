"""Ray mode of memfit batch: one BatchWorker actor per worker, jobs streamed to whichever is free.

Each actor opens the model, resolves its own budget on its own node ("auto": that node's free
memory, memfit.plan.budget.detect) and keeps its pipeline warm, so a cluster of unlike
machines plans each one for what it has. The driver keeps one job in flight per actor, so a lost
actor loses at most one job: a job whose actor died (process killed, node lost) is put back at
the head of the queue and the actor replaced, without counting as a failure of the job. A job
that fails for a reason of its own is tried once more on a fresh load (on whichever actor is
free), then recorded as failed. The driver writes every file (memfit.batch.output).

Ray is optional: ``pip install memfit[ray]``.
"""

from __future__ import annotations

import collections
import os
import sys

from memfit.batch.recording import ATTEMPTS, BatchOptions, BatchSummary, Progress, record
from memfit.batch.jobs import Job
from memfit.batch.output import BatchOutput, JobOutput
from memfit.errors import MemfitError

__all__ = ["RayPool", "run_on_ray"]

LOST_LIMIT = 3  # a job whose worker dies this many times is recorded as failed (it may be what kills them)


def import_ray():
    try:
        import ray
    except ImportError:
        raise MemfitError("--ray needs Ray, which is not installed; pip install 'memfit[ray]' "
                          "(or run without --ray to use this process only).") from None
    return ray


class RayPool:
    """The actors of one batch and the jobs in flight on them (``in_flight``: ref -> (actor index, job))."""

    def __init__(self, ray, options: BatchOptions, workers: int, cpus_per_worker: float, gpus: bool):
        from memfit.batch.worker import BatchWorker

        self.ray = ray
        self.options = options
        self.actor_class = ray.remote(BatchWorker)
        self.resources = {"num_gpus": 1, "num_cpus": cpus_per_worker} if gpus else {"num_cpus": cpus_per_worker}
        self.actors: dict[int, object] = {}
        self.in_flight: dict[object, tuple[int, Job, int]] = {}
        self.started = 0
        for _ in range(workers):
            self.start_actor()

    def start_actor(self) -> int:
        index = self.started
        self.started += 1
        # max_restarts=0: the driver replaces a dead actor itself, and re-runs its job elsewhere.
        self.actors[index] = self.actor_class.options(max_restarts=0, **self.resources).remote(
            self.options.model, name=f"ray-{index}", **self.options.worker_kwargs())
        return index

    def busy(self) -> set[int]:
        return {index for index, _, _ in self.in_flight.values()}

    def submit(self, index: int, job: Job, attempt: int) -> None:
        ref = self.actors[index].run.remote(job.to_dict(), fresh=attempt > 1)
        self.in_flight[ref] = (index, job, attempt)

    def kill(self, index: int) -> None:
        """Kill one actor now (what a lost node looks like to the driver); tests use it."""
        self.ray.kill(self.actors[index], no_restart=True)


def run_on_ray(todo: list[Job], options: BatchOptions, output: BatchOutput, summary: BatchSummary,
               progress: Progress, *, address: str, workers: int | None, cpus_per_worker: float, on_result) -> None:
    ray = import_ray()
    from ray.exceptions import RayActorError, WorkerCrashedError

    started_here = not ray.is_initialized()
    if started_here:
        init = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if address == "local":
            # Workers on this machine see memfit and its store as this process does (a source
            # checkout on PYTHONPATH included); a joined cluster's nodes keep their own environment.
            init["runtime_env"] = {"env_vars": _local_environment()}
            cpus = (workers or 1) * cpus_per_worker
            ray.init(num_cpus=max(1, int(round(cpus))), **init)
        else:
            ray.init(address=address, **init)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        count = workers or (int(gpus) if gpus else 1)
        pool = RayPool(ray, options, count, cpus_per_worker, gpus >= 1)
        queue = collections.deque((job, 1) for job in todo)
        lost: collections.Counter = collections.Counter()
        while queue or pool.in_flight:
            for index in sorted(set(pool.actors) - pool.busy()):
                if not queue:
                    break
                job, attempt = queue.popleft()
                pool.submit(index, job, attempt)
            ready, _ = ray.wait(list(pool.in_flight), num_returns=1)
            ref = ready[0]
            index, job, attempt = pool.in_flight.pop(ref)
            try:
                result: JobOutput = ray.get(ref)
            except (RayActorError, WorkerCrashedError) as exc:
                lost[job.id] += 1
                summary.requeued += 1
                pool.actors.pop(index, None)
                pool.start_actor()
                print(f"memfit batch: worker ray-{index} was lost running job {job.id!r}; "
                      "running it again on another worker", file=sys.stderr)
                if lost[job.id] < LOST_LIMIT:
                    queue.appendleft((job, attempt))
                    continue
                last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
                result = JobOutput(job.id, job.key, f"ray-{index}", 0.0,
                                   error=f"its worker was lost {LOST_LIMIT} times running it; last: {last}")
            if not result.ok and attempt < ATTEMPTS:
                queue.append((job, attempt + 1))  # once more, on a fresh load, wherever a worker is free
                continue
            line = record(output, summary, progress, job, result, attempt)
            if on_result is not None:
                on_result(pool, line)
        summary.workers = [{"worker": f"ray-{i}"} for i in sorted(pool.actors)]
    finally:
        if started_here:
            ray.shutdown()


def _local_environment() -> dict[str, str]:
    env = {name: os.environ[name] for name in ("MEMFIT_CACHE_DIR", "MEMFIT_CACHE", "MEMFIT_CACHE_MAX_BYTES", "HF_HUB_OFFLINE")
           if name in os.environ}
    if os.environ.get("PYTHONPATH"):
        # Absolute: Ray starts its workers in a directory of its own.
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p)
    return env
