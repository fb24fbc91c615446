"""The automatic budget in a run, "none", refusals through the CLI, the out-of-memory backstop and
the memory timeline (issue 13). Machine-independent: detection is pointed at fake /proc and /sys
trees where a figure matters, and the tiny models fit any machine's real free memory."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from PIL import Image

import memfit
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.plan import budget as budget_module
from memfit.plan.budget import CgroupUsage, own_cgroup_usage
from memfit.run import runner as runner_module
from memfit.run.report import RunReport
from memfit.run.options import RunOptions
from memfit.run.runner import OOM_SHRINK, Stage, StageRunner
from memfit.run.timeline import BUDGET_COLOUR, Timeline

MiB, GiB = 2**20, 2**30
RUN = dict(prompt="a red circle", steps=2, width=32, height=32, progress=False)


def _fake_container(tmp_path, limit, usage):
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job\n")
    group = sys_ / "fs" / "cgroup" / "memory" / "job"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    (group / "memory.usage_in_bytes").write_text(str(usage))
    return {"proc_root": proc, "sys_root": sys_}


def test_no_flag_plans_every_stage_resident_with_the_image_of_no_budget(tiny_models):
    model = tiny_models("sd")
    auto = memfit.generate(model=model, **RUN)
    none = memfit.generate(model=model, budget="none", **RUN)
    assert auto.report.budget["mode"] == "auto" and auto.report.budget["source"].startswith("auto: ")
    assert none.report.budget["mode"] == "none"
    planned = [s for s in auto.report.stages if s.planned_peak_bytes is not None]
    assert {"denoise", "decode"} <= {s.stage for s in planned}  # encode too, unless its cache hit skipped it
    assert all(s.planned_peak_bytes <= auto.report.budget["budget"]["device"] for s in planned)
    plans = [n for n in auto.report.notes if n.startswith("plan ")]
    assert plans and all("0 B streamed from host, 0 B streamed from disk" in n for n in plans), plans
    assert all(s.planned_peak_bytes is None for s in none.report.stages)  # none: nothing planned
    assert torch.equal(torch.as_tensor(memfit_pixels(auto)), torch.as_tensor(memfit_pixels(none)))


def memfit_pixels(result):
    import numpy as np

    return np.asarray(result.images[0])


def test_auto_budget_comes_from_the_container_in_the_report(tiny_models, tmp_path, monkeypatch):
    """The runner's budget is what detection reads at the start of the run (here a fake 2 GiB container
    with 1 GiB in use), and the report's table says where it came from."""
    roots = _fake_container(tmp_path, limit=2 * GiB, usage=GiB)
    monkeypatch.setattr(runner_module, "resolve_budget", functools.partial(budget_module.resolve_budget, **roots))
    result = memfit.generate(model=tiny_models("sd"), **RUN)
    source = result.report.budget["source"]
    assert "cgroup limit 2.00 GiB - 1.00 GiB in use" in source and "reserve 256.00 MiB" in source
    assert result.report.budget["budget"]["device"] > GiB - 256 * MiB  # + what the process holds
    assert f"budget: {source}" in result.report.table()


def test_explicit_budget_above_the_container_is_refused_by_generate(tiny_models, tmp_path, monkeypatch):
    roots = _fake_container(tmp_path, limit=600 * MiB, usage=100 * MiB)
    monkeypatch.setattr(runner_module, "resolve_budget", functools.partial(budget_module.resolve_budget, **roots))
    with pytest.raises(MemfitError, match=r"1\.00 GiB.*container.*600\.00 MiB"):
        memfit.generate(model=tiny_models("sd"), budget="1GiB", **RUN)


def test_cli_refuses_a_budget_above_this_machines_ram_naming_both(tiny_models, tmp_path, capsys):
    out = tmp_path / "o.png"
    code = main(["generate", "--model", tiny_models("sd"), "--prompt", "a red circle", "--steps", "1", "--width", "32",
                 "--height", "32", "--quiet", "--budget", "100000GiB", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "97.66 TiB" in err and "MemTotal" in err and "Traceback" not in err, err
    assert not out.exists()


def test_optimize_none_without_a_backend_is_refused(tiny_models):
    pipe = object()
    with pytest.raises(MemfitError, match="nothing to do"):
        memfit.optimize(pipe, budget="none")


# --- the out-of-memory backstop ---------------------------------------------------------------


def _runner(budget="1GiB"):
    return StageRunner(RunOptions.build(device="cpu", budget=budget, progress=False),
                       report=RunReport(device="cpu", dtype="fp32", model="m"), settings=None, guided=False)


def test_out_of_memory_replans_smaller_and_retries_from_the_same_inputs_and_seed():
    generator = torch.Generator().manual_seed(7)
    budgets = []

    def work(context, results):
        budgets.append(context.budget.device)
        given = results.pop("inputs")  # stages consume their inputs; a retry must see them again
        draw = torch.randn(4, generator=generator)
        if len(budgets) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return given, draw

    runner = _runner("1GiB")
    results = {"inputs": "embeddings"}
    runner.timeline.__enter__()
    try:
        given, draw = runner._run_stage(Stage("denoise", work, generators=(generator,)), results)
    finally:
        runner.timeline.__exit__(None, None, None)
    assert given == "embeddings"
    assert torch.equal(draw, torch.randn(4, generator=torch.Generator().manual_seed(7)))  # same random state
    assert budgets == [GiB, int(GiB * OOM_SHRINK)]
    note = next(n for n in runner.report.notes if n.startswith("denoise: out of memory"))
    assert "1.00 GiB" in note and "re-planned under" in note and "Tried to allocate" in note
    assert [s.stage for s in runner.report.stages] == ["denoise"]  # the failed attempt leaves no row


def test_out_of_memory_twice_is_a_clear_error_naming_stage_and_budgets():
    def work(context, results):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(MemfitError) as info:
        _runner("1GiB")._run_stage(Stage("decode", work), {})
    message = str(info.value)
    assert "decode" in message and "twice" in message and "1.00 GiB" in message and "716.80 MiB" in message
    assert "smaller --budget" in message


def test_out_of_memory_without_a_budget_says_to_plan_one():
    def work(context, results):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(MemfitError, match="no budget.*auto"):
        _runner("none")._run_stage(Stage("encode", work), {})


# --- the memory timeline ----------------------------------------------------------------------


def test_timeline_records_disk_reads_stages_and_memory(tiny_models, tmp_path):
    """Under a budget that streams (the unet's blocks forced to disk), every block read is a move from
    disk with its bytes, inside the recorded span; samples cover the run."""
    pipe = __import__("diffusers").StableDiffusionPipeline.from_pretrained(tiny_models("sd"))
    pipe.set_progress_bar_config(disable=True)
    memfit.optimize(pipe, force_tiers={"unet": "disk"})
    with Timeline(interval=0.01) as timeline:
        timeline.stage_started("denoise", None)
        pipe("a red circle", num_inference_steps=2, width=32, height=32, generator=torch.Generator().manual_seed(0))
        timeline.stage_ended(123)
    memfit.restore(pipe)
    moves = timeline.moves
    unet_bytes = sum(p.numel() * p.element_size() for p in pipe.unet.parameters())
    assert moves and {m.from_tier for m in moves} == {"disk"} and {m.to_tier for m in moves} == {"device"}
    assert all(m.block.startswith("unet/") and m.stage == "denoise" and m.end >= m.start for m in moves)
    # every block is read once per unet call (2 steps, guidance branches batched: 2 calls); the anchor
    # weight never moves, a few buffers of disk blocks do
    assert abs(sum(m.bytes for m in moves) - 2 * unet_bytes) < 0.05 * 2 * unet_bytes
    assert len(timeline.samples) >= 2 and all(s.rss > 0 for s in timeline.samples)
    assert timeline.stages[0].planned_peak == 123 and timeline.stages[0].end is not None

    data = json.loads(timeline.write(tmp_path / "t.json").read_text())
    assert data["moves"][0]["from_tier"] == "disk" and data["stages"][0]["stage"] == "denoise"
    png = timeline.write(tmp_path / "t.png")
    assert Image.open(png).size == (1000, 520)
    assert BUDGET_COLOUR not in set(Image.open(png).convert("RGB").getdata())  # no stage had a budget
    timeline.stages[0].budget = 2 * timeline.stages[0].planned_peak
    budget_line = [xy for xy, colour in _pixels(timeline.write(tmp_path / "b.png")) if colour == BUDGET_COLOUR]
    rows = {y for _, y in budget_line}
    assert budget_line and max(rows) - min(rows) <= 1  # one horizontal line (2 px wide), over the stage's span
    with pytest.raises(MemfitError, match=r"\.json.*\.png"):
        timeline.write(tmp_path / "t.txt")


def _pixels(png):
    image = Image.open(png).convert("RGB")
    return [((i % image.width, i // image.width), colour) for i, colour in enumerate(image.getdata())]


def test_cpu_watch_warns_once_per_stage_before_the_limit(capsys):
    readings = iter([CgroupUsage(50 * MiB, 100 * MiB), CgroupUsage(95 * MiB, 100 * MiB),
                     CgroupUsage(97 * MiB, 100 * MiB), CgroupUsage(99 * MiB, 100 * MiB)])
    timeline = Timeline(read_cgroup=lambda: next(readings))
    timeline.stage_started("denoise", None)
    for _ in range(3):
        timeline.sample()
    timeline.stage_started("decode", None)
    timeline.sample()
    err = capsys.readouterr().err
    assert err.count("memfit: during denoise") == 1 and err.count("memfit: during decode") == 1
    assert "95% of this container's limit of 100.00 MiB" in err and "smaller --budget" in err
    assert len(timeline.warnings) == 2


def test_cpu_watch_leaves_out_the_file_cache_a_streamed_run_keeps_near_the_limit(capsys):
    # A run streaming weights from a memory map: its working set sits near the limit, most of it active file pages
    # the kernel drops (and reads again) rather than kill; only what it cannot reclaim is near a kill.
    readings = iter([CgroupUsage(96 * MiB, 100 * MiB, active_file=40 * MiB),
                     CgroupUsage(97 * MiB, 100 * MiB, active_file=4 * MiB)])
    timeline = Timeline(read_cgroup=lambda: next(readings))
    timeline.stage_started("denoise", None)
    timeline.sample()
    assert capsys.readouterr().err == "" and not timeline.warnings
    timeline.sample()
    assert "93% of this container's limit" in capsys.readouterr().err
    assert [s.cgroup for s in timeline.samples] == [96 * MiB, 97 * MiB]  # the plot keeps the working set


def test_the_cgroup_reading_counts_active_file_pages_apart(tmp_path):
    proc, group = tmp_path / "proc", tmp_path / "sys" / "fs" / "cgroup" / "memory" / "job"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("4:memory:/job\n")
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(100 * MiB))
    (group / "memory.usage_in_bytes").write_text(str(90 * MiB))
    (group / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {10 * MiB}\ntotal_active_file {30 * MiB}\n")
    usage = own_cgroup_usage(proc_root=proc, sys_root=tmp_path / "sys")
    assert usage == CgroupUsage(80 * MiB, 100 * MiB, 30 * MiB)


@pytest.mark.slow
def test_cli_writes_the_timeline(tiny_models, tmp_path):
    out, timeline = tmp_path / "o.png", tmp_path / "t.json"
    assert main(["generate", "--model", tiny_models("sd"), "--prompt", "a red circle", "--steps", "1", "--width", "32",
                 "--height", "32", "--quiet", "--out", str(out), "--timeline", str(timeline)]) == 0
    data = json.loads(timeline.read_text())
    assert [s["stage"] for s in data["stages"]] == ["encode", "denoise", "decode"]
    assert data["samples"] and all(s["end"] is not None for s in data["stages"])
    assert main(["generate", "--model", tiny_models("sd"), "--prompt", "x", "--quiet", "--out", str(out),
                 "--timeline", str(tmp_path / "t.svg")]) == 2
