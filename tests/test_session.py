"""A WarmSession keeps each stage's fitted pipeline: later runs load nothing and draw the same images."""

import numpy as np
import pytest

import memfit
from memfit.run.generate import generate
from memfit.run.session import WarmSession


def _pixels(result):
    return np.asarray(result.images[0])


@pytest.mark.parametrize("budget", [None, "4GiB"])
def test_warm_runs_equal_fresh_runs_and_load_once(tiny_models, budget, monkeypatch):
    folder = tiny_models("sd")
    loads = []
    from memfit.models.folder import ModelFolder

    real_load = ModelFolder.load_stage
    monkeypatch.setattr(ModelFolder, "load_stage", lambda self, names, *a: loads.append(tuple(names)) or real_load(self, names, *a))
    session = WarmSession()
    jobs = [("a red circle", 0, 32), ("a blue square", 1, 32), ("a red circle", 2, 32)]
    warm = [generate(p, model=folder, steps=2, seed=s, width=w, height=w, budget=budget, progress=False, session=session)
            for p, s, w in jobs]
    assert len(loads) == 3, loads  # encode, denoise, decode: once each for the whole session
    assert len(session) == 3
    assert [st.note for st in warm[1].report.stages] == ["warm", "warm", "warm"]
    loads.clear()
    fresh = [generate(p, model=folder, steps=2, seed=s, width=w, height=w, budget=budget, progress=False)
             for p, s, w in jobs]
    assert len(loads) == 6  # denoise and decode per run; every prompt is in the prompt cache by now
    for a, b in zip(warm, fresh):
        assert np.array_equal(_pixels(a), _pixels(b))
    assert not np.array_equal(_pixels(warm[0]), _pixels(warm[2]))  # other seed, other image


def test_a_size_change_under_a_budget_refits_and_holds_one_fit(tiny_models):
    folder = tiny_models("sd")
    session = WarmSession()
    generate("a red circle", model=folder, steps=1, width=32, height=32, budget="4GiB", progress=False, session=session)
    first = {slot: entry.key for slot, entry in session._stages.items()}
    result = generate("a red circle", model=folder, steps=1, width=48, height=48, budget="4GiB", progress=False,
                      session=session)
    assert len(session) == 3
    now = {slot: entry.key for slot, entry in session._stages.items()}
    assert first.keys() == now.keys()  # one fit per stage, never two
    # encode's prompt came from the prompt cache, so its entry stays; denoise and decode were fitted again
    assert [first[slot] != now[slot] for slot in now] == [False, True, True]
    fresh = memfit.generate("a red circle", model=folder, steps=1, width=48, height=48, budget="4GiB", progress=False)
    assert np.array_equal(_pixels(result), _pixels(fresh))


def test_a_stage_that_does_not_fit_beside_the_warm_ones_is_planned_again_after_releasing_them(tiny_models, monkeypatch):
    from memfit.errors import MemfitError
    from memfit.run.runner import StageContext

    folder = tiny_models("sd")
    real_fit = StageContext._fit
    refused = []

    def fit(self, pipe, model, plan_as, already_used):
        if self.stage == "denoise" and self.runner.session is not None and len(self.runner.session) and not refused:
            refused.append(len(self.runner.session))
            raise MemfitError("does not fit beside the warm stages")
        return real_fit(self, pipe, model, plan_as, already_used)

    monkeypatch.setattr(StageContext, "_fit", fit)
    session = WarmSession()
    result = generate("a red circle", model=folder, steps=1, width=32, height=32, budget="4GiB", progress=False,
                      session=session)
    assert refused == [1]  # the warm encode stage was held when denoise was refused
    assert "denoise: planned again after releasing the warm stages" in result.report.notes
    assert sorted(slot[2] for slot in session._stages) == ["decode", "denoise"]  # encode was released
    fresh = memfit.generate("a red circle", model=folder, steps=1, width=32, height=32, budget="4GiB", progress=False)
    assert np.array_equal(_pixels(result), _pixels(fresh))
