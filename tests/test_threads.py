"""memfit.run.threads: the threads a run computes with, from what the process may really use (its
affinity, its cgroup's CPU quota, the CPUs others keep busy) or --threads / threads=, set for the run,
put back after it, and reported (issue 35, item 12)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import memfit
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.run import threads
from memfit.run.threads import check_threads, choose_threads, cpu_quota, usable_cpus

RUN = dict(steps=1, width=32, height=32, progress=False)


def _cgroups(tmp_path: Path, own: str, files: dict[str, str]) -> dict:
    """A fake /proc (``own``: /proc/self/cgroup's text) and /sys/fs/cgroup (``files``: path -> text)."""
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(own)
    (sys_root / "fs" / "cgroup").mkdir(parents=True)
    for path, text in files.items():
        file = sys_root / "fs" / "cgroup" / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    return {"proc_root": proc, "sys_root": sys_root}


def test_cgroup_v2_quota_is_the_smallest_on_the_way_up(tmp_path):
    roots = _cgroups(tmp_path, "0::/user.slice/job\n", {
        "user.slice/job/cpu.max": "max 100000\n",
        "user.slice/cpu.max": "150000 100000\n",  # the container's limit, one level up: 1.5 CPUs
        "cpu.max": "max 100000\n",
    })
    assert cpu_quota(**roots) == 1.5
    assert usable_cpus(affinity=set(range(8)), **roots) == (1, "CPU quota 1.5 of 8 CPUs")


def test_cgroup_v2_without_a_quota_leaves_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    roots = _cgroups(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpu_quota(**roots) is None
    assert usable_cpus(affinity={0, 1, 2, 3, 4, 5, 6, 7}, **roots) == (8, "8 CPUs")
    assert usable_cpus(affinity={2, 5}, **roots) == (2, "affinity 2 of 8 CPUs")


def test_cgroup_v1_quota_over_period_and_minus_one_is_no_limit(tmp_path):
    limited = _cgroups(tmp_path / "a", "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_quota(**limited) == 2.5
    assert usable_cpus(affinity=set(range(64)), **limited) == (2, "CPU quota 2.5 of 64 CPUs")
    unlimited = _cgroups(tmp_path / "b", "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(**unlimited) is None


def test_a_container_whose_cgroup_path_names_the_hosts_reads_its_own_root(tmp_path):
    # Inside a container /proc/self/cgroup may name the host's path, while the mount is the container's root.
    roots = _cgroups(tmp_path, "1:cpu:/kubepods/pod1/abc\n", {
        "cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert usable_cpus(affinity={0, 1, 2, 3}, **roots) == (1, "CPU quota 1 of 4 CPUs")


def test_a_quota_under_one_cpu_still_gives_one_thread(tmp_path):
    roots = _cgroups(tmp_path, "0::/\n", {"cpu.max": "20000 100000\n"})
    assert usable_cpus(affinity={0, 1}, **roots)[0] == 1


def _stat(busy: list[int]) -> str:
    """/proc/stat's per-CPU lines: user nice system idle iowait irq softirq steal."""
    return "cpu  0 0 0 0 0 0 0 0\n" + "".join(f"cpu{i} {b} 0 0 1000 0 0 0 0\n" for i, b in enumerate(busy))


@pytest.fixture
def fake_stat(tmp_path, monkeypatch):
    """A /proc with no CPU quota whose /proc/stat moves on by ``busy`` ticks per CPU during the 0.1 s look. The look's
    clock moves by what it sleeps only: on a loaded machine a real 0.1 s sleep can last twice that, which would halve
    the share of a CPU the ticks stand for."""
    roots = _cgroups(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    monkeypatch.setattr(threads, "_last_sample", None)
    clock = [1000.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])

    def during_look(busy: list[int]):
        stat = roots["proc_root"] / "stat"
        stat.write_text(_stat([0] * len(busy)))

        def sleep(seconds):
            clock[0] += seconds
            stat.write_text(_stat(busy))

        monkeypatch.setattr(threads.time, "sleep", sleep)
        monkeypatch.setattr(threads, "_last_sample", None)
        return roots

    return during_look


def test_cpus_other_processes_keep_busy_are_left_to_them(fake_stat, monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    # 100 ticks a second: 10 ticks in 0.1 s is one CPU kept fully busy by others.
    roots = fake_stat([10, 0, 0, 0])
    chosen = choose_threads(environ={}, affinity={0, 1, 2, 3}, **roots)
    assert chosen.count == 3 and "busy with other processes" in chosen.source
    roots = fake_stat([10, 10, 10, 10])
    assert choose_threads(environ={}, affinity={0, 1, 2, 3}, **roots).count == 1
    roots = fake_stat([1, 0, 0, 0])  # a tenth of a CPU: background noise, not a reason to give one up
    assert choose_threads(environ={}, affinity={0, 1, 2, 3}, **roots) == threads.ThreadCount(4, "4 CPUs")


def test_a_look_begun_as_the_run_began_costs_the_run_no_wait(tmp_path, monkeypatch):
    """generate starts looking at /proc/stat before it opens the model; choosing the threads then measures others'
    use over that time and does not sleep through a look of its own."""
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads, "_last_sample", None)
    roots = _cgroups(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    stat = roots["proc_root"] / "stat"
    stat.write_text(_stat([0, 0, 0, 0]))
    threads.start_looking_at_cpus(proc_root=roots["proc_root"])
    time.sleep(0.15)  # the model opening: others keep one CPU busy meanwhile
    stat.write_text(_stat([15, 0, 0, 0]))
    waits = []
    monkeypatch.setattr(threads.time, "sleep", waits.append)
    chosen = choose_threads(environ={}, affinity={0, 1, 2, 3}, **roots)
    assert waits == [] and chosen.count == 3
    threads.start_looking_at_cpus(proc_root=roots["proc_root"])  # a run that begins at once waits out the rest only
    choose_threads(environ={}, affinity={0, 1, 2, 3}, **roots)
    assert len(waits) == 1 and 0 < waits[0] <= threads._SAMPLE_SECONDS


def test_asked_for_and_omp_num_threads_come_first(tmp_path):
    roots = _cgroups(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    assert choose_threads(3, environ={"OMP_NUM_THREADS": "1"}, affinity={0, 1}, **roots) == \
        threads.ThreadCount(3, "asked for")
    # Ray sets OMP_NUM_THREADS in each worker to the CPUs it reserved: memfit keeps to it.
    assert choose_threads(environ={"OMP_NUM_THREADS": "2"}, affinity={0, 1}, **roots) == \
        threads.ThreadCount(2, "OMP_NUM_THREADS")
    assert choose_threads(environ={"OMP_NUM_THREADS": "lots"}, affinity={0, 1}, **roots) == \
        threads.ThreadCount(1, "CPU quota 1 of 2 CPUs")


@pytest.mark.parametrize("value", [0, -2, "x", "1.5", 1.5, 2.0, True, 10**6, "", "--3", "0x10"])
def test_a_thread_count_that_is_no_count_is_refused(value):
    with pytest.raises(MemfitError, match=r"--threads"):
        check_threads(value)


def test_a_thread_count_is_taken_as_a_number_or_its_text():
    assert check_threads(None) is None and check_threads(3) == 3 and check_threads(" 2 ") == 2


@pytest.mark.parametrize("command", ["generate", "encode", "serve", "batch"])
@pytest.mark.parametrize("value, expected", [("0", "give at least 1 thread"), ("two", "is not a whole number"),
                                             ("-3", "give at least 1 thread")])
def test_the_flag_refuses_a_bad_count_in_one_sentence(command, value, expected, tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "x"}\n')
    argv = {"generate": ["generate", "--prompt", "x", "--out", str(tmp_path / "o.png")],
            "encode": ["encode", "--prompt", "x", "--out", str(tmp_path / "e.safetensors")],
            "serve": ["serve"], "batch": ["batch", str(jobs), "--out", str(tmp_path / "out")]}[command]
    assert main([*argv, f"--threads={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memfit: error: --threads") and expected in err and err.count("\n") == 1, err
    assert "Traceback" not in err and not list(tmp_path.glob("o*"))


def test_a_run_computes_with_the_threads_asked_for_and_puts_torchs_back(tiny_models):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's own count, which must outlive the run
    try:
        during = []

        def on_step(stage, done, total):
            if stage == "denoise" and done:
                during.append(torch.get_num_threads())

        result = memfit.generate("a red circle", model=tiny_models("sd"), threads=1, on_step=on_step, **RUN)
        assert during == [1]
        assert result.report.threads == {"count": 1, "source": "asked for"}
        assert "threads: 1 (asked for)" in result.report.table()
        assert torch.get_num_threads() == 2
        _, report = memfit.encode("a red circle", model=tiny_models("sd"), threads=3)
        assert report.threads["count"] == 3 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_by_default_the_report_says_how_many_threads_and_why(tiny_models):
    result = memfit.generate("a red circle", model=tiny_models("sd"), **RUN)
    count, why = usable_cpus()
    assert 1 <= result.report.threads["count"] <= count
    assert result.report.threads["source"].startswith(why) or result.report.threads["source"] == "OMP_NUM_THREADS"


def test_the_json_report_and_a_session_carry_the_count(tiny_models, tmp_path):
    report = tmp_path / "report.json"
    assert main(["generate", "--model", tiny_models("sd"), "--prompt", "x", "--steps", "1", "--width", "32",
                 "--height", "32", "--quiet", "--threads", "1", "--out", str(tmp_path / "o.png"),
                 "--report", str(report)]) == 0
    assert json.loads(report.read_text())["threads"] == {"count": 1, "source": "asked for"}
    from memfit.run.session import Session

    session = Session(tiny_models("sd"), threads=1)
    assert session.generate("x", steps=1, width=32, height=32).report.threads["count"] == 1
    with pytest.raises(MemfitError, match="--threads 0"):
        Session(tiny_models("sd"), threads=0)


def test_a_batch_runs_its_jobs_with_the_count_and_records_it(tiny_models, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"j{i}", "prompt": "x", "steps": 1, "width": 32, "height": 32}) + "\n"
                            for i in range(2)))
    assert main(["batch", str(jobs), "--model", tiny_models("sd"), "--out", str(tmp_path / "out"), "--quiet",
                 "--threads", "1"]) == 0
    lines = [json.loads(raw) for raw in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [line["threads"] for line in lines] == [1, 1]
