"""memfit.run.session: stages kept warm between runs through the runner's pool, inside the budget."""

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


@pytest.mark.slow
def test_the_pool_lets_go_when_kept_stages_would_make_a_stage_stream(tmp_path):
    """A budget in which every stage fits alone (the denoiser with its ~60 MiB of estimated activations),
    but not with a 17 MiB text encoder kept beside it: the pool releases what it kept, the stage is
    planned as in a one-shot run, and later runs load their stages as memfit.generate does."""
    from memfit.testing import save_pipeline

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
    assert not state["warm"] and "streams" in state["reason"] and state["components"] == []
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
