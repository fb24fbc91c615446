"""memfit.run.session: stages kept warm between runs through the runner's pool, inside the budget; later
runs load nothing and draw the same images, bit for bit."""

import numpy as np
import pytest

import memfit
from memfit.run.memory import current_rss
from memfit.run.session import Interrupted, Session

MiB = 2**20
ARGS = dict(steps=1, width=32, height=32)


def notes(generation):
    return {stage.stage: stage.note for stage in generation.report.stages}


def test_stages_stay_loaded_between_runs_and_images_equal_generate(tiny_models):
    session = Session(tiny_models("sd"))
    session.generate("a red circle", seed=1, **ARGS)
    second = session.generate("a blue square", seed=2, **ARGS)
    assert notes(second) == {"encode": "warm", "denoise": "warm", "decode": "warm"}
    assert session.warm_state()["warm"] and session.warm_state()["weights_bytes"] > 0
    plain = memfit.generate("a blue square", model=tiny_models("sd"), seed=2, progress=False, **ARGS)
    assert list(second.images[0].getdata()) == list(plain.images[0].getdata())
    assert second.metadata == plain.metadata
    session.close()
    assert session.warm_state()["components"] == []


def test_without_warm_every_run_loads_its_stages(tiny_models):
    session = Session(tiny_models("sd"), warm=False)
    session.generate("a red circle", seed=1, **ARGS)
    second = session.generate("a blue square", seed=1, **ARGS)
    assert "warm" not in notes(second).values() and not session.warm_state()["warm"]


def test_an_interrupt_from_on_step_stops_the_run_and_the_session_goes_on(tiny_models):
    session = Session(tiny_models("sd"))

    def stop(stage, done, total):
        if done == 1:
            raise Interrupted("stop")

    with pytest.raises(Interrupted):
        session.generate("a red circle", seed=1, on_step=stop, steps=3, width=32, height=32)
    after = session.generate("a red circle", seed=1, **ARGS)
    plain = memfit.generate("a red circle", model=tiny_models("sd"), seed=1, progress=False, **ARGS)
    assert list(after.images[0].getdata()) == list(plain.images[0].getdata())


def test_a_run_can_be_stopped_as_each_stage_starts_before_it_loads(tiny_models):
    session = Session(tiny_models("sd"))
    calls = []

    def stop_at_denoise(stage, done, total):
        calls.append((stage, done, total))
        if (stage, total) == ("denoise", 0):
            raise Interrupted("stop")

    with pytest.raises(Interrupted):
        session.generate("a red circle", seed=1, on_step=stop_at_denoise, steps=2, width=32, height=32)
    assert calls == [("encode", 0, 0), ("denoise", 0, 0)]  # nothing of the denoise stage loaded, no step run
    assert not any(name.startswith("denoise:") for name in session.warm_state()["components"])


@pytest.mark.slow
def test_the_pool_lets_go_when_kept_stages_would_make_a_stage_stream(tmp_path, monkeypatch):
    """A budget in which every stage fits alone (the denoiser with its ~60 MiB of estimated activations),
    but not with a 17 MiB text encoder kept beside it: the pool releases what it kept, the stage is
    planned as in a one-shot run, and later runs load their stages as memfit.generate does."""
    import memfit.run.generate as generate_module
    from memfit.testing import save_pipeline

    # The up-front floor check allows for ~1/8 growth of this process (what a cold CPU run gains), more
    # than this budget's margin over the planned denoise stage; the pool is what is tested here.
    monkeypatch.setattr(generate_module, "check_budget_floor", lambda *args, **kwargs: None)

    model = save_pipeline("sd", tmp_path / "sd", seed=0, scale=4, text_layers=32)
    # Measured, so the test holds whatever this process already holds: what the denoise stage plans
    # for when it runs alone, and the text encoder's weights a warm session would keep beside it.
    cold = Session(model, budget=current_rss() + 4096 * MiB, warm=False).generate("a red circle", seed=1, **ARGS)
    stages = {stage.stage: stage for stage in cold.report.stages}
    denoise, encoder = stages["denoise"], stages["encode"].weights_bytes
    assert encoder > 16 * MiB
    budget = denoise.planned_peak_bytes + encoder // 2  # fits the denoiser alone, not beside the text encoder
    session = Session(model, budget=budget)
    session.generate("a blue square", seed=1, **ARGS)
    state = session.warm_state()
    # Beside the encoder the denoiser streams weights, or (as this process grows) does not fit at all.
    assert not state["warm"] and "with the other stages kept loaded" in state["reason"] and state["components"] == []
    second = session.generate("a green circle", seed=2, **ARGS)
    assert "warm" not in notes(second).values()
    plain = memfit.generate("a green circle", model=model, seed=2, progress=False, **ARGS)
    assert list(second.images[0].getdata()) == list(plain.images[0].getdata())


def test_a_sampler_without_an_equivalent_is_refused_before_anything_loads(tiny_models):
    from memfit.errors import MemfitError
    from memfit.run.samplers import resolve_sampler, sampler_names

    with pytest.raises(MemfitError, match="no diffusers equivalent; use one of: Euler, Euler a"):
        memfit.generate("a red circle", model=tiny_models("sd"), sampler="DPM fast", progress=False, **ARGS)
    assert sampler_names("FlowMatchEulerDiscreteScheduler") == ["Euler"]
    with pytest.raises(MemfitError, match="does not fit this model's FlowMatchEulerDiscreteScheduler"):
        resolve_sampler("DDIM", "FlowMatchEulerDiscreteScheduler")
    assert resolve_sampler("DPM++ 2M Karras", "PNDMScheduler") == ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True})


def test_a1111_schedule_types_and_aliases_are_read_as_a1111_reads_them():
    import diffusers

    from memfit.errors import MemfitError
    from memfit.run.samplers import resolve_sampler, sampler_label, schedules_for, split_sampler

    def label(name, scheduler=None):
        return sampler_label(*split_sampler(name, scheduler, "PNDMScheduler"))

    # a schedule type's name or label; one in the sampler's name wins, as in A1111
    assert label("DPM++ 2M", "karras") == label("DPM++ 2M", "Karras") == label("DPM++ 2M Karras", "exponential") \
        == "DPM++ 2M Karras"
    assert label("k_euler_a", "automatic") == label("Euler a", "") == "Euler a"
    assert label("DPM++ 2M SDE", "sgm_uniform") == label("DPM++ 2M SDE SGMUniform") == "DPM++ 2M SDE SGM Uniform"
    cls, overrides = resolve_sampler("Euler SGM Uniform", "PNDMScheduler")
    built = getattr(diffusers, cls).from_config(diffusers.PNDMScheduler().config, **overrides)
    assert built.config.timestep_spacing == "trailing"
    # EulerAncestral takes no Karras sigmas: from_config would drop them without a word, so it is refused
    assert [s.name for s in schedules_for("PNDMScheduler", "Euler a")] == ["automatic", "sgm_uniform", "simple"]
    with pytest.raises(MemfitError, match="cannot follow the Karras schedule type on this model; use one of: "
                                          "Automatic, SGM Uniform, Simple"):
        resolve_sampler("Euler a Karras", "PNDMScheduler")
    with pytest.raises(MemfitError, match="'Align Your Steps' is not a schedule type memfit can follow"):
        split_sampler("Euler", "Align Your Steps", "PNDMScheduler")
    assert [s.name for s in schedules_for("FlowMatchEulerDiscreteScheduler")] == ["automatic"]


def _pixels(result):
    return np.asarray(result.images[0])


def _stages_kept(session):
    return sorted({component.split(":")[0] for component in session.warm_state()["components"]})


@pytest.mark.parametrize("budget", [None, "4GiB"])
def test_warm_runs_equal_fresh_runs_and_load_once(tiny_models, budget, monkeypatch):
    folder = tiny_models("sd")
    loads = []
    from memfit.models.folder import ModelFolder

    real_load = ModelFolder.load_stage
    monkeypatch.setattr(ModelFolder, "load_stage",
                        lambda self, names, *a, **k: loads.append(tuple(names)) or real_load(self, names, *a, **k))
    session = Session(folder, budget=budget)
    jobs = [("a red circle", 0, 32), ("a blue square", 1, 32), ("a red circle", 2, 32)]
    warm = [session.generate(p, steps=2, seed=s, width=w, height=w) for p, s, w in jobs]
    assert len(loads) == 3, loads  # encode, denoise, decode: once each for the whole session
    assert _stages_kept(session) == ["decode", "denoise", "encode"]
    assert [st.note for st in warm[1].report.stages] == ["warm", "warm", "warm"]
    loads.clear()
    fresh = [memfit.generate(p, model=folder, steps=2, seed=s, width=w, height=w, budget=budget, progress=False)
             for p, s, w in jobs]
    assert len(loads) == 6  # denoise and decode per run; every prompt is in the prompt cache by now
    for a, b in zip(warm, fresh):
        assert np.array_equal(_pixels(a), _pixels(b))
    assert not np.array_equal(_pixels(warm[0]), _pixels(warm[2]))  # other seed, other image


def test_a_size_change_under_a_budget_refits_and_holds_one_fit(tiny_models):
    folder = tiny_models("sd")
    session = Session(folder, budget="4GiB")
    session.generate("a red circle", steps=1, width=32, height=32)
    first = {slot: made_for for slot, (made_for, *_) in session.pool._pipes.items()}
    result = session.generate("a red circle", steps=1, width=48, height=48)
    now = {slot: made_for for slot, (made_for, *_) in session.pool._pipes.items()}
    assert first.keys() == now.keys() and len(now) == 3  # one fit per stage, never two
    # encode's prompt came from the prompt cache, so its entry stays; denoise and decode were fitted again
    assert [first[slot] != now[slot] for slot in now] == [False, True, True]
    fresh = memfit.generate("a red circle", model=folder, steps=1, width=48, height=48, budget="4GiB", progress=False)
    assert np.array_equal(_pixels(result), _pixels(fresh))


def test_a_stage_that_does_not_fit_beside_the_warm_ones_is_planned_again_after_releasing_them(tiny_models, monkeypatch):
    import memfit.run.runner as runner
    from memfit.plan.budget import StageDoesNotFit

    folder = tiny_models("sd")
    real_fit = runner.fit_stage
    refused = []

    def fit(pipe, model, names, options, *, stage, **kwargs):
        if stage == "denoise" and options.pool is not None and options.pool.holds_any() and not refused:
            refused.append(_stages_kept(session))
            raise StageDoesNotFit("does not fit beside the warm stages")
        return real_fit(pipe, model, names, options, stage=stage, **kwargs)

    monkeypatch.setattr(runner, "fit_stage", fit)
    session = Session(folder, budget="4GiB")
    result = session.generate("a red circle", steps=1, width=32, height=32)
    assert refused == [["encode"]]  # the warm encode stage was held when denoise was refused
    assert any(note.startswith("denoise: planned again after releasing the warm stages") for note in result.report.notes)
    state = session.warm_state()  # from then on the session runs like memfit.generate
    assert not state["warm"] and "does not fit" in state["reason"] and state["components"] == []
    fresh = memfit.generate("a red circle", model=folder, steps=1, width=32, height=32, budget="4GiB", progress=False)
    assert np.array_equal(_pixels(result), _pixels(fresh))
