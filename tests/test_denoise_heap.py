"""On the CPU the denoising loop takes its temporaries from the heap where its plan counts the holes the heap
keeps (memfit.plan.activations.heap_slack); where a budget has no room for them, the stage runs without it,
not refused."""

from __future__ import annotations

import pytest

import memfit
from memfit.plan.activations import DENOISE_HEAP_THRESHOLD, HEAP_SLACK_CEILING, heap_slack
from memfit.plan.planner import minimum_device_bytes
from memfit.plan.stages import stage_options
from memfit.run import memory
from memfit.run.stages import open_model

SIZE = 128


def _denoise_floor(model: str, heap: bool) -> int:
    """The smallest budget above the process the denoise stage can be planned in, all of it streamed."""
    options = stage_options(open_model(model).adapter, dtype="fp32", width=SIZE, height=SIZE, steps=2,
                            heap_temporaries=heap)
    return min(minimum_device_bytes(stage) for opts in options for _, stage in opts if stage.name == "denoise")


def _run(model: str, budget: str):
    """A generation under ``budget`` and the mmap threshold each denoising step ran under."""
    thresholds = []

    def on_step(stage, done, total):
        if stage == "denoise" and total:
            thresholds.append(memory._fixed_threshold)

    result = memfit.generate("a red circle", model=model, steps=2, width=SIZE, height=SIZE, budget=budget,
                             on_step=on_step, progress=False)
    return result, thresholds


def test_heap_slack_counts_the_widest_temporaries_the_heap_serves():
    assert heap_slack(0) == 0
    assert heap_slack(2**20) == 7 * 2**20
    # A temporary above the threshold is a mapping of its own: the holes are at most the threshold's size.
    assert heap_slack(4 * DENOISE_HEAP_THRESHOLD) == heap_slack(DENOISE_HEAP_THRESHOLD) == HEAP_SLACK_CEILING


def test_the_loop_uses_the_heap_where_the_plan_has_room_and_not_where_it_has_none(tiny_models):
    model = tiny_models("sd")
    without, with_heap = _denoise_floor(model, heap=False), _denoise_floor(model, heap=True)
    assert with_heap - without > 4 * 2**20  # the holes are counted

    # Room for the stage streamed, not for the heap's holes as well: planned (and run) without them. First: the
    # holes the roomy run's loop leaves count in every later plan of the process (memory.heap_holes).
    tight, thresholds = _run(model, f"+{(without + with_heap) // 2}")
    assert thresholds and set(thresholds) == {memory.HEAP_MMAP_THRESHOLD}
    assert not any("from the heap" in note for note in tight.report.notes)
    roomy, thresholds = _run(model, "+1GiB")
    assert thresholds and set(thresholds) == {DENOISE_HEAP_THRESHOLD}
    assert any("from the heap" in note for note in roomy.report.notes)
    assert memory._fixed_threshold == memory.HEAP_MMAP_THRESHOLD  # back once the loop is done

    assert [s.strategy for s in tight.report.stages[1:]] == [s.strategy for s in roomy.report.stages[1:]]
    assert tight.images[0].tobytes() == roomy.images[0].tobytes()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_memfit_plan_counts_the_heap_on_the_cpu_only(tiny_models, device, capsys):
    import json

    from memfit.cli.app import main

    model = tiny_models("sd")
    main(["plan", "--model", model, "--width", str(SIZE), "--height", str(SIZE), "--budget", "1GiB", "--device",
          device, "--json"])
    denoise = {s["name"]: s for s in json.loads(capsys.readouterr().out)["plan"]["stages"]}["denoise"]
    options = stage_options(open_model(model).adapter, dtype="fp32", width=SIZE, height=SIZE, heap_temporaries=False)
    live = next(stage.activation_bytes for opts in options for _, stage in opts if stage.name == "denoise")
    assert (denoise["activation_bytes"] > live) == (device == "cpu")


def test_the_holes_a_loop_left_in_the_heap_count_in_each_later_stage_plan(tiny_models, monkeypatch):
    """A stage may take the heap's free chunks back (its pages re-fault) and keep them until it ends: the holes
    memory.heap_holes says earlier loops left count in what the process already holds when a stage is planned."""
    from memfit.run import runner

    model = tiny_models("sd")
    planned = {}
    for holes in (0, 64 * 2**20):
        monkeypatch.setattr(runner, "heap_holes", lambda holes=holes: holes)
        result, _ = _run(model, "+1GiB")
        planned[holes] = {stage.stage: stage.planned_peak_bytes for stage in result.report.stages}
    for stage, peak in planned[0].items():
        if peak is None or planned[64 * 2**20][stage] is None:
            continue  # an encode from the prompt cache plans nothing
        assert abs(planned[64 * 2**20][stage] - peak - 64 * 2**20) < 4 * 2**20, stage


def _mapped_bytes() -> int:
    """The bytes glibc serves with mmap now (mallinfo2's hblkhd)."""
    return int(memory._mallinfo().hblkhd)


@pytest.fixture
def threshold_left_to_glibc(monkeypatch):
    """This test as a process in which memfit fixed no mmap threshold; the process's own setting back after it."""
    fixed = memory._fixed_threshold
    monkeypatch.setattr(memory, "_fixed_threshold", None)
    yield
    if fixed is not None:
        memory._set_mmap_threshold(fixed)


def test_with_no_threshold_fixed_a_stretch_takes_temporaries_of_every_size_from_the_heap(threshold_left_to_glibc):
    """Inside every_temporary_from_heap a block over glibc's 32 MiB ceiling comes from the heap, not from a fresh
    mapping; glibc maps such blocks again after it. Under a fixed threshold (a budget) nothing changes."""
    import torch

    if memory._mallinfo() is None:
        pytest.skip("glibc's mallinfo2 is not there")
    wide = 4 * DENOISE_HEAP_THRESHOLD  # bytes, over glibc's ceiling

    def mapped_while_held() -> int:
        """Bytes newly mapped while a block no free chunk of the heap can hold is alive (wider than all of them)."""
        nbytes = memory._heap_free_bytes() + wide
        before = _mapped_bytes()
        held = torch.empty(nbytes, dtype=torch.uint8)
        grown = _mapped_bytes() - before
        del held
        return grown

    assert mapped_while_held() >= wide
    with memory.every_temporary_from_heap():
        assert mapped_while_held() == 0
    assert mapped_while_held() >= wide
    assert not memory.mmap_threshold_fixed()  # glibc's thresholds, not one memfit fixed

    memory.return_large_frees_to_os()
    with memory.every_temporary_from_heap():
        assert mapped_while_held() >= wide


def test_the_plain_decode_takes_the_heap_only_where_no_threshold_is_fixed_and_plans_its_holes(
        tiny_models, threshold_left_to_glibc, monkeypatch):
    """Where memfit fixed no mmap threshold (the automatic budget holds everything), the plain decode runs inside
    every_temporary_from_heap and its planned peak counts the activations once more; after a budgeted run (the
    threshold fixed) it does not. The images are the same."""
    from memfit.run import stages

    model = tiny_models("sd")
    entered = []

    def recorded():
        entered.append(True)
        return memory.every_temporary_from_heap()

    monkeypatch.setattr(stages, "every_temporary_from_heap", recorded)
    runs = {}
    for fixed, dtype in ((False, "bf16"), (False, "fp32"), (True, "fp32")):
        if fixed:
            memory.return_large_frees_to_os()
        entered.clear()
        result = memfit.generate("a red circle", model=model, steps=2, width=SIZE, height=SIZE, dtype=dtype,
                                 progress=False)
        runs[fixed, dtype] = (result, bool(entered))
    (heap, heap_entered), (plain, plain_entered) = runs[False, "fp32"], runs[True, "fp32"]
    assert heap_entered and not plain_entered
    assert not runs[False, "bf16"][1]  # a bf16 decode: not measured to gain from the heap
    assert any("temporaries of every size from the heap" in note for note in heap.report.notes)
    assert not any("temporaries of every size from the heap" in note for note in plain.report.notes)
    decode = {run: next(s for s in result.report.stages if s.stage == "decode") for run, result in
              (("heap", heap), ("plain", plain))}
    assert decode["heap"].strategy == decode["plain"].strategy == "plain"
    assert decode["heap"].planned_peak_bytes > decode["plain"].planned_peak_bytes
    assert heap.images[0].tobytes() == plain.images[0].tobytes()


def test_memfit_plan_counts_the_decode_heap_where_a_run_takes_it(tiny_models, capsys):
    """`memfit plan` decides as a run does: under the automatic budget on the CPU, where everything stays
    resident, the plain decode's activations include its heap (decode_heap_slack); under an explicit budget
    (a run then fixes the mmap threshold) or for a GPU, they do not."""
    import json

    from memfit.cli.app import main
    from memfit.plan.activations import decode_heap_slack

    model = tiny_models("sd")
    options = stage_options(open_model(model).adapter, dtype="fp32", width=SIZE, height=SIZE, steps=2)
    plain = next(stage.activation_bytes for opts in options for _, stage in opts[:1] if stage.name == "decode")

    def planned_decode(*budget: str) -> int:
        main(["plan", "--model", model, "--width", str(SIZE), "--height", str(SIZE), "--steps", "2", "--json",
              *budget])
        stages = {s["name"]: s for s in json.loads(capsys.readouterr().out)["plan"]["stages"]}
        return stages["decode"]["activation_bytes"]

    assert planned_decode() == plain + decode_heap_slack(next(
        strategy.activation_bytes for opts in options for strategy, stage in opts[:1] if stage.name == "decode"))
    assert planned_decode("--budget", "4GiB") == plain
    assert planned_decode("--budget", "4GiB", "--device", "cuda") == plain
    # A bf16 decode: the heap was not measured to speed it up (memfit.plan.activations.decode_gains_from_heap).
    options = stage_options(open_model(model).adapter, dtype="bf16", width=SIZE, height=SIZE, steps=2)
    plain_bf16 = next(stage.activation_bytes for opts in options for _, stage in opts[:1] if stage.name == "decode")
    assert planned_decode("--dtype", "bf16") == plain_bf16
