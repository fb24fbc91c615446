"""memfit batch on a local Ray cluster: 2 worker actors of 1 CPU each, one killed mid-batch.

Ray is an optional extra (memfit[ray], not installed by `make test`'s set-up): skipped without it.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from memfit.batch import BatchOptions, JobDefaults, run_batch  # noqa: E402

pytestmark = pytest.mark.slow


def _jobs(path: Path, count: int) -> Path:
    prompts = ["a red circle", "a blue square", "a green triangle"]
    path.write_text("".join(json.dumps({"id": f"j{i}", "prompt": prompts[i % 3], "seed": i}) + "\n" for i in range(count)))
    return path


def _options(model, out) -> BatchOptions:
    return BatchOptions(model=model, out=out, budget="auto", progress=False,
                        defaults=JobDefaults(steps=2, width=32, height=32))


def test_a_killed_worker_s_job_runs_again_elsewhere_and_nothing_is_lost_or_doubled(tiny_models, tmp_path, capfd):
    model = tiny_models("sd")
    path = _jobs(tmp_path / "jobs.jsonl", 10)
    killed = []

    def kill_one_busy_worker(pool, line):
        if killed:
            return
        busy = {index for index, _, _ in pool.in_flight.values()}
        if busy:
            killed.append(min(busy))
            pool.kill(min(busy))

    out = tmp_path / "ray"
    summary = run_batch(path, _options(model, out), ray="local", workers=2, on_result=kill_one_busy_worker)
    assert killed, "no worker had a job in flight to kill"
    assert summary.requeued >= 1 and (summary.done, summary.failed) == (10, 0)
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == sorted(f"j{i}" for i in range(10))  # each exactly once
    # The job lost is the one the driver says it lost: the job in flight when the kill was sent may have
    # finished just before it, and the next job sent to the dead actor is lost instead.
    lost = re.search(rf"worker ray-{killed[0]} was lost running job '(j\d+)'", capfd.readouterr().err)
    assert lost, "the driver did not report the lost job"
    rerun = next(line for line in lines if line["id"] == lost.group(1))
    assert not rerun["worker"].startswith(f"ray-{killed[0]}@")  # finished by another actor
    assert len({line["worker"] for line in lines}) >= 2
    assert not list(out.glob(".*.tmp"))
    # Every image is the one local mode (and so memfit generate) makes for the job with the same torch
    # threads (the actors' OMP_NUM_THREADS), as CPU kernels split their sums by threads.
    reference = tmp_path / "local"
    (threads,) = {line["threads"] for line in lines}
    run_batch(path, dataclasses.replace(_options(model, reference), threads=threads))
    for i in range(10):
        assert (out / f"j{i}.png").read_bytes() == (reference / f"j{i}.png").read_bytes(), f"j{i}"


def test_a_job_failing_twice_on_ray_is_recorded_and_the_batch_goes_on(tiny_models, tmp_path):
    model = tiny_models("sd")
    # A job's own failure, found only when it runs: more steps than the scheduler has timesteps.
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"id": "ok", "prompt": "a red circle"}) + "\n"
                    + json.dumps({"id": "too-many-steps", "prompt": "a red circle", "steps": 5000}) + "\n")
    out = tmp_path / "ray"
    summary = run_batch(path, _options(model, out), ray="local", workers=2)
    assert (summary.done, summary.failed) == (1, 1)
    lines = {line["id"]: line for line in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert lines["ok"]["status"] == "ok"
    assert lines["too-many-steps"]["status"] == "failed" and lines["too-many-steps"]["attempts"] == 2
    assert lines["too-many-steps"]["error"]
