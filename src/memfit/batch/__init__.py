"""memfit batch: many jobs from a JSONL file, resumable, in this process or on a Ray cluster.

memfit.batch.jobs reads and checks the jobs; memfit.batch.output owns the output folder (atomic
PNGs, results.jsonl, resume); memfit.batch.worker runs jobs on a warm pipeline; memfit.batch.driver
runs a batch locally; memfit.batch.ray_pool on Ray (optional extra ``memfit[ray]``).
"""

from memfit.batch.driver import run_batch
from memfit.batch.jobs import BadLine, Job, JobDefaults, read_jobs
from memfit.batch.recording import BatchOptions, BatchSummary

__all__ = ["BadLine", "BatchOptions", "BatchSummary", "Job", "JobDefaults", "read_jobs", "run_batch"]
