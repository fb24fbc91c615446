"""The run-level GPU path (issue 14): loading on the host and planning before anything moves, budget
accounting and peaks on a device with memory of its own, empty_cache between stages, out-of-memory
errors as one sentence, and devices memfit cannot stream to (mps, xpu).

Runs go through the fake CUDA runtime (memfit.testing.fake_cuda); figures that come from torch's
allocator are tested with ``torch.cuda`` patched. The fake runs lazily (a copy completes only when
waited for) and inside inference mode: its pending copies may then run at the end of a stage,
outside the pipeline's own no-grad call, into tensors made inside it.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import memfit
from memfit.cli.app import main
from memfit.devices import CudaRuntime, PlainRuntime, runtime_for
from memfit.errors import MemfitError
from memfit.models.families import Settings
from memfit.models.folder import ModelFolder
from memfit.plan.budget import StageDoesNotFit, resolve_budget
from memfit.run import runner as runner_module
from memfit.plan.activations import DEVICE_ACTIVATION_MARGIN
from memfit.run.memory import PeakMemory
from memfit.run.options import RunOptions, resolve_device
from memfit.run.report import RunReport
from memfit.run.runner import Stage, StageRunner
from memfit.testing.fake_cuda import fake_cuda

KiB, MiB, GiB = 2**10, 2**20, 2**30
RUN = dict(prompt="a red circle", steps=2, width=32, height=32, progress=False)


@contextlib.contextmanager
def fake_gpu(total_memory: int = 80 * GiB):
    """A lazy fake GPU of ``total_memory`` bytes that runs out of memory as a real one does: a copy
    that would take its reserved memory past the total raises torch.OutOfMemoryError."""
    with fake_cuda(lazy=True, total_memory=total_memory) as gpu, torch.inference_mode():
        copy = gpu.to_device

        def capped(host, dtype=None):
            nbytes = host.numel() * (dtype or host.dtype).itemsize
            if gpu.memory_reserved() + nbytes > gpu.total_memory:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes (fake)")
            return copy(host, dtype)

        def capped_buffer(nbytes):
            if gpu.memory_reserved() + nbytes > gpu.total_memory:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes (fake)")
            return buffer(nbytes)

        buffer = gpu.device_buffer
        gpu.to_device, gpu.device_buffer = capped, capped_buffer
        yield gpu


@pytest.fixture
def load_devices(monkeypatch):
    """The ``device`` argument of every ModelFolder.load_stage call."""
    devices = []
    original = ModelFolder.load_stage

    def spy(self, names, dtype, device=None, **kwargs):
        devices.append(device)
        return original(self, names, dtype, device, **kwargs)

    monkeypatch.setattr(ModelFolder, "load_stage", spy)
    return devices


def _weights(folder, component) -> int:
    from pathlib import Path

    return sum(f.stat().st_size for f in (Path(folder) / component).glob("*.safetensors"))


# --- defect 1: load on the host, plan, move only what the plan keeps on the device ---------------


def test_a_stage_larger_than_the_gpu_runs_within_its_plan(tiny_models, streamed_plans, load_devices):
    model = tiny_models("sd")
    total = _weights(model, "unet") * 3 // 4  # the unet alone would not fit on this GPU
    with fake_gpu(total) as gpu:
        result = memfit.generate(model=model, device="cuda", budget={"device": total // 2, "host": "1GiB"}, **RUN)
    assert result.images[0].size == (32, 32)
    assert load_devices and all(device is None for device in load_devices)  # every stage loaded on the host
    stages = {s.stage: s for s in result.report.stages}
    assert stages["denoise"].weights_bytes > total
    planned = [plan.stages[0] for plan in streamed_plans]
    assert [p.name for p in planned] == ["encode", "denoise", "decode"]
    assert planned[1].streamed_from_host_bytes > 0
    slack = {plan.name: _slot_alignment(model, plan) for plan in planned}
    for plan in planned:
        figures = stages[plan.name].device_memory
        assert figures["peak_allocated"] <= plan.resident_bytes + plan.stream_window_bytes + slack[plan.name], plan.name
        assert figures["load_peak_allocated"] <= plan.resident_bytes, plan.name
    assert gpu.max_memory_allocated() <= max(p.resident_bytes + p.stream_window_bytes + slack[p.name] for p in planned)


def _slot_alignment(model, plan) -> int:
    """The most the streamed blocks' slots (memfit.run.offload.BlockSlots) can take beyond the plan's window:
    each tensor of the window's blocks starts on an ALIGNMENT boundary."""
    from diffusers import DiffusionPipeline

    from memfit.run.executor import live_blocks
    from memfit.run.offload import ALIGNMENT

    pipe = DiffusionPipeline.from_pretrained(model)
    streamed = {f"{p.component}/{p.block}": p.bytes for p in plan.placements if p.where != "device"}
    tensors = {block.key: sum(len(found) for _, found in block.units)
               for name in {key.split("/")[0] for key in streamed} for block in live_blocks(name, getattr(pipe, name))}
    window = sorted(streamed, key=lambda key: -streamed[key])[:2]  # 1 + prefetch
    return ALIGNMENT * sum(tensors[key] for key in window)


def test_without_a_budget_each_stage_moves_whole_after_loading(tiny_models, load_devices):
    with fake_gpu() as gpu:
        result = memfit.generate(model=tiny_models("sd"), device="cuda", budget="none", **RUN)
    assert all(device is None for device in load_devices)
    for stage in result.report.stages:
        if stage.weights_bytes:
            assert stage.device_memory["load_peak_allocated"] >= stage.weights_bytes, stage.stage
    assert gpu.memory_allocated() == 0  # every stage's weights left with the stage


# --- defect 5: budget accounting on the GPU --------------------------------------------------------


@pytest.fixture
def patched_cuda(monkeypatch):
    """torch.cuda as one 8 GiB GPU that another process fills: set ``figures`` to change what it says."""
    figures = {"free": 2 * GiB, "total": 8 * GiB, "allocated": 300 * MiB, "reserved": 1 * GiB,
               "max_allocated": 5 * GiB, "max_reserved": 6 * GiB, "retries": 0, "resets": 0}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (figures["free"], figures["total"]))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: figures["allocated"])
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: figures["reserved"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: figures["max_allocated"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: figures["max_reserved"])
    monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {"num_alloc_retries": figures["retries"]})
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats",
                        lambda device=None: figures.__setitem__("resets", figures["resets"] + 1))
    monkeypatch.setattr("memfit.devices._cuda_runtimes", {})
    return figures


def test_stage_baseline_on_a_gpu_is_allocated_memory(patched_cuda):
    runtime = runtime_for("cuda")
    assert isinstance(runtime, CudaRuntime)
    assert runtime.memory_in_use() == patched_cuda["allocated"]


def test_the_automatic_budget_on_a_gpu_counts_the_allocators_cache(patched_cuda):
    """Issue 34, item 10: the automatic budget added free memory to what the caller counted in use (allocated
    tensors), so the allocator's cached blocks, which mem_get_info counts as used and the run reuses, were in
    neither: 700 MiB of this GPU lost. Now what the process holds counts at least its reserved memory."""
    runtime = runtime_for("cuda")
    resolved = resolve_budget("auto", runtime, in_use=runtime.memory_in_use())
    reserve = resolved.budget.device - (patched_cuda["free"] + patched_cuda["reserved"])
    assert -GiB <= reserve < 0  # free + held, less the device reserve (256 MiB to 1 GiB)
    assert "+ 1.00 GiB this process holds" in resolved.source


def test_an_explicit_budget_above_what_the_gpu_can_give_now_is_refused(patched_cuda):
    runtime = runtime_for("cuda")
    # 2 GiB free + 1 GiB this process's allocator holds: 3 GiB; another process holds the other 5.
    assert resolve_budget("3GiB", runtime).budget.device == 3 * GiB
    with pytest.raises(MemfitError) as info:
        resolve_budget("4GiB", runtime)
    message = str(info.value)
    assert "3.00 GiB (2.00 GiB free + 1.00 GiB this process holds" in message
    assert "5.00 GiB is held by other processes" in message and "--budget 3072MiB" in message
    with pytest.raises(MemfitError, match="above the total memory of cuda:0"):
        resolve_budget("9GiB", runtime)


def test_an_explicit_budget_is_checked_against_the_fake_gpu_free_memory(tiny_models):
    with fake_gpu(64 * MiB) as gpu:
        gpu.mem_get_info = lambda: (16 * MiB, gpu.total_memory)  # another process holds 48 MiB
        with pytest.raises(MemfitError, match="above what cuda:0 \\(fake\\) can give this run now, 16.00 MiB"):
            memfit.generate(model=tiny_models("sd"), device="cuda", budget="32MiB", **RUN)


def test_the_automatic_budget_is_detected_before_anything_is_on_the_gpu(tiny_models, monkeypatch, load_devices):
    seen = []
    original = runner_module.resolve_budget

    def detecting(value, runtime, **kwargs):
        seen.append((runtime.memory_allocated(), len(load_devices)))
        return original(value, runtime, **kwargs)

    monkeypatch.setattr(runner_module, "resolve_budget", detecting)
    with fake_gpu(4 * GiB):
        result = memfit.generate(model=tiny_models("sd"), device="cuda", **RUN)
    assert seen == [(0, 0)]  # nothing on the device, no stage loaded yet
    assert result.report.budget["source"].startswith("auto: cuda:0 (fake) free 4.00 GiB of 4.00 GiB")


def test_activation_estimates_get_the_device_margin_on_a_gpu_only(tiny_models, monkeypatch):
    import memfit.run.fit as fit

    asked, offered = [], []
    plan_stage, stage_strategies = fit.plan_stage, fit.stage_strategies

    def planning(pipe, budget, stage, activation_bytes=0, parts=None, **options):
        asked.append(activation_bytes)
        return plan_stage(pipe, budget, stage, activation_bytes, parts, **options)

    def strategies(*args, **kwargs):
        options = stage_strategies(*args, **kwargs)
        offered.append(options[0].activation_bytes)
        return options

    monkeypatch.setattr(fit, "plan_stage", planning)
    monkeypatch.setattr(fit, "stage_strategies", strategies)
    memfit.generate(model=tiny_models("sd"), device="cpu", budget="8GiB", **RUN)
    assert asked == offered and all(asked)
    asked.clear(), offered.clear()
    with fake_gpu():
        memfit.generate(model=tiny_models("sd"), device="cuda", budget="8GiB", **RUN)
    assert asked == [int(bytes_ * DEVICE_ACTIVATION_MARGIN) for bytes_ in offered]


# --- defect 7: empty_cache between stages, out of memory as one sentence --------------------------


def test_the_device_cache_is_emptied_between_stages(tiny_models, load_devices):
    events = []
    with fake_gpu() as gpu:
        empty_cache = gpu.empty_cache
        gpu.empty_cache = lambda: events.append("empty_cache") or empty_cache()
        original_load = ModelFolder.load_stage
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ModelFolder, "load_stage",
                          lambda self, *a, **k: events.append("load") or original_load(self, *a, **k))
            memfit.generate(model=tiny_models("sd"), device="cuda", budget="none", **RUN)
    loads = [i for i, event in enumerate(events) if event == "load"]
    assert len(loads) == 3
    for previous, following in zip(loads, loads[1:]):
        assert "empty_cache" in events[previous:following]  # the stage before released its cache
    assert events[-1] == "empty_cache"


def test_a_stage_that_does_not_fit_the_gpu_without_a_budget_is_one_sentence(tiny_models):
    model = tiny_models("sd")
    with fake_gpu(_weights(model, "unet") // 2), pytest.raises(MemfitError) as info:
        memfit.generate(model=model, device="cuda", budget="none", **RUN)
    message = str(info.value)
    assert "denoise stage ran out of memory with no budget" in message and "Tried to allocate" in message
    assert "\n" not in message


def test_out_of_memory_outside_a_stage_retry_is_one_sentence(monkeypatch):
    runner = StageRunner(RunOptions.build(device="cpu", budget="1GiB", progress=False),
                         report=RunReport(device="cuda", dtype="fp32", model="m"), settings=None, guided=False)

    def failing(stage, results):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB\nmore lines")

    monkeypatch.setattr(runner, "_run_stage", failing)
    with pytest.raises(MemfitError) as info:
        runner.run([Stage("decode", lambda context, results: None)])
    assert str(info.value).startswith("The device ran out of memory in the decode stage (CUDA out of memory. "
                                      "Tried to allocate 20.00 MiB); give a smaller --budget")


def test_the_cli_prints_a_device_out_of_memory_as_one_sentence(tiny_models, monkeypatch, capsys, tmp_path):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr("memfit.run.generate.generate", out_of_memory)
    code = main(["generate", "--prompt", "a red circle", "--model", tiny_models("sd"), "--out", str(tmp_path / "a.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("memfit: error: The device ran out of memory outside the stages memfit plans (CUDA out of "
                          "memory. Tried to allocate 64.00 MiB)")
    assert "Traceback" not in err and err.count("\n") == 1


# --- defect 8: reported peaks -----------------------------------------------------------------------


def test_peaks_on_a_gpu_come_from_the_allocator_and_reset_after_loading(patched_cuda):
    runtime = runtime_for("cuda")
    with PeakMemory(runtime) as peak:
        patched_cuda["retries"] = 2
        peak.loaded()  # loading peaked at 5 GiB allocated, 6 GiB reserved
        patched_cuda.update(max_allocated=3 * GiB, max_reserved=4 * GiB)
    figures = peak.device_peaks
    assert (figures.load_peak_allocated, figures.load_peak_reserved) == (5 * GiB, 6 * GiB)
    assert (figures.peak_allocated, figures.peak_reserved) == (3 * GiB, 4 * GiB)
    assert patched_cuda["resets"] == 2  # at the start and after loading
    assert figures.alloc_retries == 2 and figures.peak_rss > 0
    assert peak.peak_bytes == 5 * GiB and peak.start_bytes == patched_cuda["allocated"]


def test_gpu_reports_give_allocated_reserved_pinned_and_rss_and_cpu_reports_stay(tiny_models, tmp_path,
                                                                                 streamed_plans):
    with fake_gpu():
        result = memfit.generate(model=tiny_models("sd"), device="cuda",
                                 budget={"device": "400KiB", "host": "1GiB"}, **RUN)
    result.report.write_json(tmp_path / "gpu.json")
    stages = json.loads((tmp_path / "gpu.json").read_text())["stages"]
    denoise = next(s for s in stages if s["stage"] == "denoise")["device_memory"]
    assert denoise["pinned_bytes"] > 0  # its streamed blocks' host copies
    assert 0 < denoise["load_peak_allocated"] < denoise["peak_allocated"] <= denoise["peak_reserved"]
    assert denoise["peak_rss"] > 0 and denoise["alloc_retries"] == 0
    table = result.report.table()
    assert "peak allocated" in table and "peak reserved" in table and "pinned" in table and "peak RSS" in table

    cpu = memfit.generate(model=tiny_models("sd"), device="cpu", budget="8GiB", **RUN)
    assert all("device_memory" not in stage for stage in cpu.report.to_dict()["stages"])
    assert "peak RSS" in cpu.report.table() and "peak allocated" not in cpu.report.table()


# --- devices memfit cannot stream to ------------------------------------------------------------------


@pytest.mark.parametrize("kind, where", [("mps", "torch.backends.mps.is_available"),
                                         ("xpu", "torch.xpu.is_available")])
def test_mps_and_xpu_are_accepted_where_torch_has_them(kind, where, monkeypatch):
    monkeypatch.setattr(where, lambda: True)
    assert resolve_device(kind) == torch.device(kind)
    monkeypatch.setattr(where, lambda: False)
    with pytest.raises(MemfitError, match=f"--device {kind} names a {kind} device but torch .* sees none here"):
        resolve_device(kind)


def test_other_device_types_are_refused_by_name():
    with pytest.raises(MemfitError, match="--device meta is not supported by memfit; use cpu, cuda, cuda:N, mps"):
        resolve_device("meta")


def test_the_automatic_budget_on_mps_is_the_host_memory(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    (proc / "self" / "cgroup").write_text("")
    resolved = resolve_budget("auto", PlainRuntime(torch.device("mps")), proc_root=proc, sys_root=tmp_path)
    assert resolved.source.startswith("auto: mps shares host RAM (unified memory): MemAvailable 8.00 GiB")
    assert resolved.budget.device == 8 * GiB - 2 * GiB and resolved.budget.host == 0
    with pytest.raises(MemfitError, match="above this machine's RAM"):
        resolve_budget("20GiB", PlainRuntime(torch.device("mps")), proc_root=proc, sys_root=tmp_path)


def _plain_runner(budget):
    """A runner on a device memfit cannot stream to; its tensors live on the CPU so torch can run them."""
    runtime = PlainRuntime(torch.device("cpu"))
    runtime.mem_get_info = lambda: (8 * GiB, 8 * GiB)
    return StageRunner(RunOptions.build(device=runtime, budget=budget, progress=False),
                       report=RunReport(device="mps", dtype="fp32", model="m"),
                       settings=Settings("a red circle", "", steps=2, guidance=7.5, seed=0, width=32, height=32),
                       guided=True)


def test_a_device_that_cannot_stream_runs_stages_that_fit_whole(tiny_models, streamed_plans):
    folder = ModelFolder.open(tiny_models("sd"))
    runner = _plain_runner("1GiB")
    unets = runner.run([Stage("denoise", lambda context, results: context.load(folder, ["unet"]).unet)])
    assert unets["denoise"] is not None and runner.report.stages[0].components == ["unet"]


def test_a_device_that_cannot_stream_refuses_a_plan_that_streams(tiny_models, streamed_plans):
    folder = ModelFolder.open(tiny_models("sd"))
    runner = _plain_runner(_weights(tiny_models("sd"), "unet") // 2)
    with pytest.raises(StageDoesNotFit, match="streams weights only on cuda and cpu devices, not cpu"):
        runner.run([Stage("denoise", lambda context, results: context.load(folder, ["unet"]))])
    assert streamed_plans == []  # refused before anything was placed


# --- issue 34, item 8: a Session keeps the pinned host tier --------------------------------------------


def test_a_session_keeps_the_pinned_host_tier_filled_between_runs(tiny_models, tmp_path, monkeypatch,
                                                                  streamed_plans):
    """Every optimize page-locked and filled the whole host tier again (18 GB a run for Flux at a quarter
    resident), also in a Session, whose pool keeps no pipeline of a stage that streams. Now the pool keeps the
    filled arenas (memfit.run.executor.KeptHostTiers): the second run page-locks none and reads none (it draws
    what a kept arena holds), says so, and draws the first run's image; a weight file changed in place is another
    content, read again; host RAM too short for a new arena gives back the kept ones first; closing the session
    gives everything back."""
    import dataclasses
    import shutil

    from memfit.plan import budget as budget_module
    from memfit.run.session import Session

    model = tmp_path / "sd"
    shutil.copytree(tiny_models("sd"), model)
    SESSION_RUN = {key: value for key, value in RUN.items() if key != "progress"}  # a Session shows none
    with fake_gpu() as gpu:
        session = Session(model, device="cuda", budget={"device": "400KiB"})
        first = session.generate(**SESSION_RUN)
        pinned, arenas = gpu.pinned_bytes(), len(gpu.pinned_arenas())
        assert pinned > 0 and session.pool.host_tiers.nbytes() == pinned  # kept, not given back
        second = session.generate(**SESSION_RUN)
        assert len(gpu.pinned_arenas()) == arenas and gpu.pinned_bytes() == pinned  # none page-locked again
        notes = [n for n in second.report.notes if "kept from the last run" in n]
        streamed = {s.stage for s in first.report.stages if any(t.get("host") for t in s.tiers.values())}
        assert streamed and {n.split(":")[0] for n in notes} == streamed
        assert second.images[0].tobytes() == first.images[0].tobytes()

        unet = model / "unet" / "diffusion_pytorch_model.safetensors"
        unet.write_bytes(unet.read_bytes())  # the same bytes, another file: read again, never trusted
        third = session.generate(**SESSION_RUN)
        assert not any("denoise: its pinned host tier" in n for n in third.report.notes)
        assert third.images[0].tobytes() == first.images[0].tobytes()
        assert gpu.pinned_bytes() == pinned  # one arena kept per stage: the stale one went back

        for arena, _, _ in session.pool.host_tiers._kept.values():  # what the next run finds is what it uses
            arena.zero_()
        assert session.generate(**SESSION_RUN).images[0].tobytes() != first.images[0].tobytes()

        kept = session.pool.host_tiers.nbytes()
        real = budget_module.read_host_memory
        monkeypatch.setattr(budget_module, "read_host_memory",
                            lambda **kw: dataclasses.replace(real(**kw), mem_available=0, cgroup_limit=None))
        session.pool.host_tiers.make_room(1)
        assert session.pool.host_tiers.nbytes() == 0 < kept and gpu.pinned_bytes() == 0
        monkeypatch.setattr(budget_module, "read_host_memory", real)
        session.generate(**SESSION_RUN)
        assert gpu.pinned_bytes() > 0
        session.close()
        assert gpu.pinned_bytes() == 0 and session.pool.host_tiers.nbytes() == 0


def test_the_plan_host_figure_counts_the_pinned_homes_of_a_phase_kept_resident(tiny_models, streamed_plans):
    """Issue 33: on a GPU the blocks an expert of Wan 2.2 keeps resident while it runs keep their pinned host home
    (they go back to it at the switch), which the plan's host figure left out: 51.5 MB page-locked against 25.8 MB
    planned with the tiny experts. Now each phase stage counts its own resident blocks' homes too."""
    from pathlib import Path

    from safetensors import safe_open

    from memfit.run.offload import ALIGNMENT

    model = tiny_models("wan22")
    experts = [sum(p.stat().st_size for p in (Path(model) / name).glob("*.safetensors"))
               for name in ("transformer", "transformer_2")]
    pinned = []
    with fake_gpu() as gpu:
        memfit.generate(model=model, device="cuda", budget={"device": 3 * max(experts) // 2, "host": "1GiB"},
                        num_frames=5, guidance=5.0, on_step=lambda stage, done, total: pinned.append(gpu.pinned_bytes()),
                        **{**RUN, "steps": 4})
    denoise = next(plan for plan in streamed_plans if any(s.name.startswith("denoise:") for s in plan.stages))
    assert {s.name for s in denoise.stages} == {"denoise:transformer", "denoise:transformer_2"}
    assert all(s.resident_bytes > max(experts) // 2 for s in denoise.stages)  # each expert kept mostly resident
    tensors = 0  # each pinned tensor starts on an ALIGNMENT boundary in its arena, which starts on a page
    for name in ("transformer", "transformer_2"):
        for path in (Path(model) / name).glob("*.safetensors"):
            with safe_open(path, "pt") as weights:
                tensors += len(list(weights.keys()))
    assert max(pinned) > sum(experts) * 9 // 10  # both experts' homes are page-locked during the stage
    assert max(pinned) <= denoise.host_peak_bytes + tensors * ALIGNMENT + 2 * 4096
