"""Every budget refusal takes one form: the budget the user gave, the smallest that works (in bytes)
and what it is made of, whichever check refuses (the run's floor before anything loads, a stage's plan,
the process's own memory, the planner alone)."""

import re

import pytest

import memfit
import memfit.run.generate
from memfit.errors import MemfitError
from memfit.plan.budget import Budget, BudgetTooSmall, stage_budget
from memfit.plan.planner import BlockSpec, StageInput, make_plan, minimum_device_bytes
from memfit.sizes import format_bytes
from memfit.testing.runtimes import WeightsOnlyCpu

MiB = 2**20
HELD = 300 * MiB  # what the process holds before any weight, as Python and torch do
SMALLEST = re.compile(r"the smallest budget that works is (\d+) bytes")


class HoldsSome(WeightsOnlyCpu):
    """The CPU with a process that holds a fixed HELD bytes before memfit places weights."""

    def memory_in_use(self) -> int:
        return HELD


def _refusal(**kwargs) -> str:
    with pytest.raises(BudgetTooSmall) as caught:
        memfit.generate("a red circle", steps=2, width=64, height=64, progress=False, device=HoldsSome(), **kwargs)
    return str(caught.value)


@pytest.mark.parametrize("floor_checked", [True, False], ids=["run-floor", "stage-plan"])
def test_a_refusal_names_the_budget_given_and_a_smallest_budget_that_works(tiny_models, monkeypatch, floor_checked):
    """The stage's plan sees only what is left once the process's own memory is counted; its refusal
    still names the budget the user passed (not what was left of it) and a budget that includes that
    memory: passing the budget it names gets past that refusal."""
    if not floor_checked:
        monkeypatch.setattr(memfit.run.generate, "check_budget_floor", lambda *args, **kwargs: None)
    given = HELD + 64 * 1024
    message = _refusal(model=tiny_models("sd"), budget=given)
    assert message.startswith(f"The budget of {format_bytes(given)} is below the smallest that can work"), message
    assert "this process" in message
    needed = int(SMALLEST.search(message).group(1))
    assert needed > HELD
    assert f"Give --budget {-(-needed // MiB)}MiB or more" in message
    for _ in range(4):  # a later stage may need more: each refusal names the user's budget and a larger one
        try:
            memfit.generate("a red circle", model=tiny_models("sd"), steps=2, width=64, height=64, progress=False,
                            device=HoldsSome(), budget=needed)
            return
        except BudgetTooSmall as exc:
            assert str(exc).startswith(f"The budget of {format_bytes(needed)} "), str(exc)
            larger = int(SMALLEST.search(str(exc)).group(1))
            assert larger > needed
            needed = larger
    pytest.fail("no budget named by the refusals was enough")


def test_a_budget_the_process_already_fills_is_refused_in_the_same_form():
    with pytest.raises(BudgetTooSmall) as caught:
        stage_budget(Budget(device=HELD // 2), WeightsOnlyCpu(), already_used=HELD)
    message = str(caught.value)
    assert message.startswith(f"The budget of {format_bytes(HELD // 2)} is below the smallest that can work")
    assert f"the smallest budget that works is above {HELD} bytes" in message
    assert "Give --budget more than 300MiB" in message


def test_the_planner_alone_names_its_stages_floor():
    stage = StageInput(name="denoise", blocks=tuple(BlockSpec("unet", f"block{i}", 10 * MiB) for i in range(4)),
                       activation_bytes=5 * MiB)
    floor = minimum_device_bytes(stage)
    with pytest.raises(MemfitError) as caught:
        make_plan([stage], floor - 1)
    message = str(caught.value)
    assert message.startswith(f"The budget of {format_bytes(floor - 1)} is below")
    assert int(SMALLEST.search(message).group(1)) == floor
    assert "activations 5.00 MiB" in message
    make_plan([stage], floor)  # the budget named plans
