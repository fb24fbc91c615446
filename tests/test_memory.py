"""memfit.run.memory: garbage collection scoped to a run; the process's peak RSS across memfit's per-stage resets."""

import gc
import resource
import weakref

import numpy as np
import pytest

import memfit
from memfit.run.memory import (
    collects_only_its_own_garbage,
    freeze_the_run_set_up,
    read_peak_rss,
    release_freed_memory,
    reset_peak_rss,
)


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_a_run_collects_what_it_made_and_leaves_older_objects_to_after():
    older = _Node()
    older_ref = weakref.ref(older)
    del older  # cyclic garbage from before the run
    seen = {}

    @collects_only_its_own_garbage
    def run():
        seen["frozen"] = gc.get_freeze_count()
        made = _Node()
        made_ref = weakref.ref(made)
        del made
        gc.collect()
        seen["made_freed"] = made_ref() is None
        seen["older_alive"] = older_ref() is not None
        return "result"

    assert run() == "result"
    assert seen["frozen"] > 0 and seen["made_freed"] and seen["older_alive"]
    assert gc.get_freeze_count() == 0  # unfrozen afterwards: collection is as it was
    gc.collect()
    assert older_ref() is None


def test_the_set_up_of_a_run_is_frozen_too_and_its_stages_are_still_collected():
    """What a run made before its first stage (the modules a model's opening imported) is frozen out of the
    stage-end collections; what a stage makes afterwards is still collected; outside a run nothing is frozen."""
    freeze_the_run_set_up()
    assert gc.get_freeze_count() == 0
    seen = {}

    @collects_only_its_own_garbage
    def run():
        set_up = _Node()
        set_up_ref = weakref.ref(set_up)
        frozen = gc.get_freeze_count()
        freeze_the_run_set_up()
        seen["set_up_frozen"] = gc.get_freeze_count() > frozen
        del set_up
        stage = _Node()
        stage_ref = weakref.ref(stage)
        del stage
        gc.collect()
        seen["stage_freed"] = stage_ref() is None
        seen["set_up_kept"] = set_up_ref() is not None
        return set_up_ref

    set_up_ref = run()
    assert seen == {"set_up_frozen": True, "stage_freed": True, "set_up_kept": True}
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert set_up_ref() is None


def test_a_callers_own_freeze_is_left_alone():
    kept = _Node()
    kept_ref = weakref.ref(kept)
    del kept
    gc.freeze()  # the caller's: its frozen cycle must stay frozen through the run and after
    try:
        collects_only_its_own_garbage(lambda: None)()
        gc.collect()
        assert kept_ref() is not None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    gc.collect()
    assert kept_ref() is None


@pytest.mark.slow
def test_generate_unfreezes_even_when_it_fails(tiny_models):
    model = tiny_models("sd")
    memfit.generate("a red circle", model=model, steps=1, width=32, height=32, progress=False)
    assert gc.get_freeze_count() == 0
    with pytest.raises(memfit.MemfitError, match="width 33"):
        memfit.generate("a red circle", model=model, steps=1, width=33, height=32, progress=False)
    assert gc.get_freeze_count() == 0


def test_the_process_peak_survives_the_resets_of_a_run(tiny_models):
    """memfit resets the kernel's high-water mark at every stage, and ru_maxrss with it; process_peak_rss still
    reports a spike from before the run."""
    model = tiny_models("sd")
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here: memfit samples RSS and never resets the mark")
    spike = np.ones(384 * 2**20 // 8)  # written, so every page is resident
    spiked = read_peak_rss()
    del spike
    release_freed_memory()
    memfit.generate("a red circle", model=model, steps=1, width=32, height=32, progress=False)
    forgotten = 256 * 2**20
    assert read_peak_rss() < spiked - forgotten  # the kernel's mark lost the spike to the stages' resets ...
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < spiked - forgotten  # ... and so did ru_maxrss
    assert memfit.process_peak_rss() >= spiked - 2**20  # the kernel's RSS counters are batched, a few pages off
