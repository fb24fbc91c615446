"""Sizes, budgets and memory detection (fake /proc and /sys trees for both cgroup versions)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memfit.plan.budget import (
    DEFAULT_HOST_RESERVE,
    Budget,
    cgroup_free_memory,
    detect_budget,
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
    budget = detect_budget(reserve="1GiB", **roots)
    assert budget.device == 8 * GiB - GiB - GiB  # limit - usage - reserve
    assert budget.host == 0  # on the CPU, device memory is host memory


def test_cgroup_v2_max_means_no_limit(tmp_path):
    roots = _fake_machine(
        tmp_path, 4 * 2**20, "0::/job", {"job/memory.max": "max", "job/memory.current": "12345"}
    )
    assert cgroup_free_memory(**roots) is None
    assert detect_budget(**roots).device == 4 * GiB - DEFAULT_HOST_RESERVE


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
    assert detect_budget(reserve=0, **roots).device == 4 * GiB


def test_cgroup_v1_huge_limit_means_no_limit(tmp_path):
    roots = _fake_machine(
        tmp_path,
        mem_available_kib=3 * 2**20,
        cgroup_line="4:memory:/",
        files={"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"},
    )
    assert cgroup_free_memory(**roots) is None
    assert detect_budget(reserve="512MiB", **roots).device == 3 * GiB - 512 * MiB


def test_meminfo_wins_when_smaller_than_cgroup_room(tmp_path):
    roots = _fake_machine(tmp_path, 2 * 2**20, "0::/", {"memory.max": str(64 * GiB), "memory.current": "0"})
    assert detect_budget(reserve=0, **roots).device == 2 * GiB


def test_reserve_larger_than_memory_gives_zero_not_negative(tmp_path):
    roots = _fake_machine(tmp_path, 1024, "0::/", {})
    assert detect_budget(**roots).device == 0


def test_unknown_device_is_an_error(tmp_path):
    roots = _fake_machine(tmp_path, 2**20, "0::/", {})
    with pytest.raises(MemfitError, match="tpu"):
        detect_budget("tpu", **roots)


def test_cuda_without_cuda_says_so(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    roots = _fake_machine(tmp_path, 2**20, "0::/", {})
    with pytest.raises(MemfitError, match="no CUDA"):
        detect_budget("cuda", **roots)
