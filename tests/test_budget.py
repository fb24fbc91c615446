"""Sizes, budgets and memory detection (fake /proc and /sys trees for both cgroup versions)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memfit.plan.budget import (
    DEFAULT_HOST_RESERVE,
    Budget,
    cgroup_free_memory,
    detect,
)
from memfit.sizes import format_bytes, parse_size
from memfit.errors import MemfitError

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", 6 * GiB),
        ("6GB", 6 * 10**9),
        ("6gib", 6 * GiB),
        ("6Gb", 6 * 10**9),  # bytes, never bits
        ("512MiB", 512 * MiB),
        ("1.5 GiB", int(1.5 * GiB)),
        ("100", 100),
        ("  2 KiB ", 2048),
        ("0", 0),
        (".5GiB", GiB // 2),
        (4096, 4096),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["six GB", "6 GiBs", "", "-1GB", "6 Gbit", "1e9", "GiB", -5, 1.5, None, True])
def test_parse_size_rejects_with_a_helpful_message(bad):
    with pytest.raises(MemfitError) as info:
        parse_size(bad)
    message = str(info.value)
    assert repr(bad) in message  # names the bad value
    assert "GiB" in message  # and shows what would work


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1536, 5 * MiB + 123, 4 * GiB, 3 * 2**40])
def test_format_bytes_round_trips_within_rounding(n):
    text = format_bytes(n)
    assert abs(parse_size(text.replace(" ", "")) - n) <= max(1, n * 0.005)


def test_format_bytes_picks_readable_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(4 * GiB) == "4.00 GiB"


def test_budget_of_widens_scalars_and_mappings():
    assert Budget.of("4GiB") == Budget(device=4 * GiB)
    assert Budget.of(123) == Budget(device=123)
    existing = Budget(device=1, host=2, disk="/x")
    assert Budget.of(existing) is existing
    assert Budget.of({"device": "1GiB", "host": 2 * GiB, "disk": Path("/tmp/w")}) == Budget(GiB, 2 * GiB, "/tmp/w")


def test_budget_fields_parse_sizes_and_stay_frozen():
    budget = Budget(device="4GiB", host="8GB")
    assert (budget.device, budget.host) == (4 * GiB, 8 * 10**9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        budget.device = 1  # type: ignore[misc]
    assert budget.to_dict() == {"device": 4 * GiB, "host": 8 * 10**9, "disk": None}


@pytest.mark.parametrize("bad", [{"gpu": "4GiB"}, 4.5, ["4GiB"], {"device": "lots"}])
def test_budget_of_rejects_unknown_shapes(bad):
    with pytest.raises(MemfitError):
        Budget.of(bad)


# --- detection on fake /proc and /sys ---------------------------------------------------------


def _fake_machine(tmp_path: Path, mem_available_kib: int, cgroup_line: str, files: dict[str, str]):
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {mem_available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for relative, content in files.items():
        path = sys / "fs" / "cgroup" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content + "\n")
    return {"proc_root": proc, "sys_root": sys}


def test_cgroup_v2_limit_caps_the_cpu_budget(tmp_path):
    roots = _fake_machine(
        tmp_path,
        mem_available_kib=32 * 2**20,  # 32 GiB free on the machine
        cgroup_line="0::/user.slice/job",
        files={"user.slice/job/memory.max": str(8 * GiB), "user.slice/job/memory.current": str(GiB)},
    )
    budget = detect(reserve="1GiB", **roots).budget
    assert budget.device == 8 * GiB - GiB - GiB  # limit - usage - reserve
    assert budget.host == 0  # on the CPU, device memory is host memory


def test_cgroup_v2_max_means_no_limit(tmp_path):
    roots = _fake_machine(
        tmp_path, 4 * 2**20, "0::/job", {"job/memory.max": "max", "job/memory.current": "12345"}
    )
    assert cgroup_free_memory(**roots) is None
    assert detect(**roots).budget.device == 4 * GiB - DEFAULT_HOST_RESERVE


def test_cgroup_v1_limit_read_from_own_memory_cgroup(tmp_path):
    roots = _fake_machine(
        tmp_path,
        mem_available_kib=32 * 2**20,
        cgroup_line="5:cpu,cpuacct:/other\n4:memory:/docker/abc",
        files={
            "memory/docker/abc/memory.limit_in_bytes": str(6 * GiB),
            "memory/docker/abc/memory.usage_in_bytes": str(2 * GiB),
            "memory/memory.limit_in_bytes": str(GiB),  # the root's value must not be used
        },
    )
    assert cgroup_free_memory(**roots) == 4 * GiB
    assert detect(reserve=0, **roots).budget.device == 4 * GiB


def test_cgroup_v1_huge_limit_means_no_limit(tmp_path):
    roots = _fake_machine(
        tmp_path,
        mem_available_kib=3 * 2**20,
        cgroup_line="4:memory:/",
        files={"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"},
    )
    assert cgroup_free_memory(**roots) is None
    assert detect(reserve="512MiB", **roots).budget.device == 3 * GiB - 512 * MiB


def test_meminfo_wins_when_smaller_than_cgroup_room(tmp_path):
    roots = _fake_machine(tmp_path, 2 * 2**20, "0::/", {"memory.max": str(64 * GiB), "memory.current": "0"})
    assert detect(reserve=0, **roots).budget.device == 2 * GiB


def test_reserve_larger_than_memory_gives_zero_not_negative(tmp_path):
    roots = _fake_machine(tmp_path, 1024, "0::/", {})
    assert detect(**roots).budget.device == 0


def test_unknown_device_is_an_error(tmp_path):
    roots = _fake_machine(tmp_path, 2**20, "0::/", {})
    with pytest.raises(MemfitError, match="tpu"):
        detect("tpu", **roots)


def test_cuda_without_cuda_says_so(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    roots = _fake_machine(tmp_path, 2**20, "0::/", {})
    with pytest.raises(MemfitError, match="no CUDA"):
        detect("cuda", **roots)


# --- the automatic budget, "none", refusals ---------------------------------------------------

from memfit.plan.budget import HostMemory, host_reserve, read_host_memory, resolve_budget  # noqa: E402


def _container(tmp_path, *, limit, usage, inactive=0, mem_available=32 * GiB, mem_total=64 * GiB, v2=False):
    if v2:
        files = {"job/memory.max": str(limit), "job/memory.current": str(usage),
                 "job/memory.stat": f"anon {usage - inactive}\ninactive_file {inactive}\nactive_file 0"}
        line = "0::/job"
    else:
        files = {"memory/job/memory.limit_in_bytes": str(limit), "memory/job/memory.usage_in_bytes": str(usage),
                 "memory/job/memory.stat": f"cache {inactive}\nrss {usage - inactive}\ntotal_inactive_file {inactive}"}
        line = "4:memory:/job"
    roots = _fake_machine(tmp_path, mem_available // 1024, line, files)
    (roots["proc_root"] / "meminfo").write_text(
        f"MemTotal: {mem_total // 1024} kB\nMemFree: 1 kB\nMemAvailable: {mem_available // 1024} kB\n")
    return roots


def test_reserve_scales_with_the_memory_there_is():
    assert host_reserve(600 * MiB) == 75 * MiB  # 1/8: a 600 MiB container keeps most of it
    assert host_reserve(128 * MiB) == 64 * MiB  # floor
    assert host_reserve(24 * GiB) == 2 * GiB  # ceiling
    assert host_reserve(600 * MiB) < host_reserve(4 * GiB) < host_reserve(64 * GiB)


@pytest.mark.parametrize("v2", [False, True])
def test_auto_budget_in_a_600_MiB_container(tmp_path, v2):
    """limit - working set (usage less inactive page cache) + what this process holds - reserve."""
    roots = _container(tmp_path, limit=600 * MiB, usage=300 * MiB, inactive=100 * MiB, v2=v2)
    host = read_host_memory(**roots)
    assert (host.cgroup_limit, host.cgroup_usage, host.cgroup_room) == (600 * MiB, 200 * MiB, 400 * MiB)
    resolved = resolve_budget("auto", "cpu", in_use=150 * MiB, **roots)
    assert resolved.mode == "auto"
    assert resolved.budget == Budget(device=150 * MiB + 400 * MiB - 75 * MiB, host=0)
    for words in ("cgroup limit 600.00 MiB", "200.00 MiB in use", "150.00 MiB this process holds",
                  "reserve 75.00 MiB", "= 475.00 MiB"):
        assert words in resolved.source, resolved.source


def test_auto_budget_without_a_container_uses_memavailable(tmp_path):
    roots = _container(tmp_path, limit=2**63 - 4096, usage=GiB, mem_available=10 * GiB, mem_total=16 * GiB)
    resolved = resolve_budget(None, "cpu", **roots)  # None is auto
    assert resolved.budget.device == 10 * GiB - 2 * GiB
    assert resolved.source.startswith("auto: MemAvailable 10.00 GiB of 16.00 GiB")


def test_memavailable_below_the_cgroup_room_wins(tmp_path):
    roots = _container(tmp_path, limit=8 * GiB, usage=GiB, mem_available=3 * GiB, mem_total=4 * GiB)
    resolved = resolve_budget("AUTO", "cpu", **roots)
    assert resolved.budget.device == 3 * GiB - host_reserve(4 * GiB)
    assert "MemAvailable" in resolved.source and "cgroup" not in resolved.source


@pytest.mark.parametrize("value", ["none", "None", " NONE "])
def test_none_turns_planning_off(tmp_path, value):
    resolved = resolve_budget(value, "cpu", **_container(tmp_path, limit=600 * MiB, usage=0))
    assert resolved.budget is None and resolved.mode == "none" and resolved.source.startswith("none:")


def test_explicit_budget_above_the_container_limit_is_refused_naming_both(tmp_path):
    roots = _container(tmp_path, limit=600 * MiB, usage=100 * MiB)
    with pytest.raises(MemfitError) as info:
        resolve_budget("1GiB", "cpu", **roots)
    message = str(info.value)
    assert "1.00 GiB" in message and "600.00 MiB" in message and "container" in message
    assert "auto" in message  # says what to do instead
    ok = resolve_budget("590MiB", "cpu", **roots)
    assert ok.budget == Budget(device=590 * MiB) and ok.mode == "explicit" and "590.00 MiB" in ok.source


def test_explicit_budget_above_the_machines_ram_is_refused(tmp_path):
    roots = _container(tmp_path, limit=2**63 - 4096, usage=0, mem_total=16 * GiB)
    with pytest.raises(MemfitError, match=r"32\.00 GiB.*MemTotal.*16\.00 GiB"):
        resolve_budget({"device": "32GiB"}, "cpu", **roots)


def test_host_memory_total_is_the_smaller_of_limit_and_ram():
    assert HostMemory(mem_available=GiB, mem_total=16 * GiB, cgroup_limit=600 * MiB).total == 600 * MiB
    assert HostMemory(mem_available=GiB, mem_total=16 * GiB).total == 16 * GiB


def test_report_table_says_where_the_budget_came_from():
    from memfit.run.report import RunReport

    report = RunReport(device="cpu", dtype="fp32", model="m",
                       budget={"mode": "auto", "source": "auto: cgroup limit 600.00 MiB - ...", "budget": None})
    assert "budget: auto: cgroup limit 600.00 MiB" in report.table()
    assert report.to_dict()["budget"]["mode"] == "auto"


def test_a_budget_on_top_of_the_process_counts_only_what_a_stage_adds():
    from memfit.plan.budget import ABOVE_PROCESS, stage_start_budget

    resolved = resolve_budget(" +64MiB", "cpu", in_use=400 * 2**20)
    assert resolved.mode == ABOVE_PROCESS and resolved.budget.device == 64 * 2**20
    assert "64.00 MiB above what this process holds" in resolved.source
    # a stage that starts with 450 MiB held may grow the process to 514 MiB
    assert stage_start_budget(resolved.budget, 450 * 2**20).device == 514 * 2**20
    with pytest.raises(MemfitError, match="Cannot read 'lots'"):
        resolve_budget("+lots", "cpu")
