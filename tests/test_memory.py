"""memfit.run.memory: garbage collection scoped to a run."""

import gc
import weakref

import pytest

import memfit
from memfit.run.memory import collects_only_its_own_garbage


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
