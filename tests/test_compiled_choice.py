"""Which compiled models a stage's budget keeps whole, compiles in blocks or runs eagerly (memfit.plan.compiled),
on made-up sizes: the choice is pure, like the planner."""

import ast
from pathlib import Path

import pytest

from memfit.plan.budget import BudgetTooSmall, StageDoesNotFit
from memfit.plan.compiled import COMPILED_BLOCK_BUILD, COMPILED_BLOCK_OVERHEAD, COMPILED_WHOLE_BUILD, \
    choose_compiled, compiled_blocks_extra

MiB = 2**20
COMPILED = {"unet": 600 * MiB, "vae": 100 * MiB}


def choice(budget_mib, *, stored=("unet", "vae"), blockable=("unet",), fallback_eager=False, converted=None):
    # 300 MiB: what the process and the stage's activations take before any compiled model
    return choose_compiled(stage="denoise", budget_bytes=None if budget_mib is None else budget_mib * MiB,
                           already_used=300 * MiB, compiled=COMPILED, stored=set(stored), blockable=blockable,
                           fallback_eager=fallback_eager, converted=converted)


def test_models_that_fit_are_kept_whole():
    assert choice(1000).kept == COMPILED and choice(1000).in_blocks == () and choice(1000).notes == ()
    assert choice(None).kept == COMPILED  # no budget: nothing to choose


def test_a_model_that_does_not_fit_whole_is_compiled_in_blocks_where_it_can_be():
    # The UNet, whose forward runs block by block, is compiled in blocks planned like weights (on the CPU).
    fitted = choice(900)
    assert fitted.kept == {"vae": 100 * MiB} and fitted.in_blocks == ("unet",) and fitted.dropped == ()


def test_what_cannot_be_split_and_does_not_fit_is_refused_naming_the_budget():
    with pytest.raises(BudgetTooSmall, match="smallest budget that works is 419430400 bytes.*--budget 400MiB") as refused:
        choice(350)
    assert refused.value.needed == 400 * MiB and isinstance(refused.value, StageDoesNotFit)
    # ...as is all of it where nothing can be compiled in blocks (memory that is the device's own).
    with pytest.raises(BudgetTooSmall, match="--budget 1000MiB") as refused:
        choice(900, blockable=())
    assert refused.value.needed == 1000 * MiB


def test_a_refused_build_names_the_smallest_budget_that_builds_it():
    # Nothing stored, nothing blockable: the budget named holds the models and the build of the largest, and no
    # byte less does.
    with pytest.raises(BudgetTooSmall) as refused:
        choice(900, stored=(), blockable=())
    needed = refused.value.needed
    assert needed == (300 + 700) * MiB + int(COMPILED_WHOLE_BUILD * 600 * MiB)
    assert "more while it is built" in str(refused.value)
    assert choose_compiled(stage="denoise", budget_bytes=needed, already_used=300 * MiB, compiled=COMPILED,
                           stored=set(), blockable=()).kept == COMPILED
    with pytest.raises(BudgetTooSmall):
        choose_compiled(stage="denoise", budget_bytes=needed - 1, already_used=300 * MiB, compiled=COMPILED,
                        stored=set(), blockable=())


def test_with_fallback_eager_the_largest_run_eagerly_and_the_report_says_so():
    fitted = choice(900, blockable=(), fallback_eager=True)
    assert fitted.kept == {"vae": 100 * MiB} and fitted.dropped == ("unet",) and fitted.in_blocks == ()
    assert "unet run eagerly" in fitted.notes[-1]


def test_a_model_not_stored_yet_counts_its_build():
    # Not stored, the UNet is built on its first call, which needs more than the model: the budget that holds
    # it stored does not hold its build, so it is compiled in blocks, and the note names the budget that stores it.
    fitted = choice(1000, stored={"vae"})
    assert fitted.kept == {"vae": 100 * MiB} and fitted.in_blocks == ("unet",)
    whole_build = 300 + 700 + int(COMPILED_WHOLE_BUILD * 600)
    assert "unet compiled in blocks" in fitted.notes[-1] and f"--budget {whole_build}MiB" in fitted.notes[-1]
    # Built from files in another dtype than the run's, the build reads the torch weights converted, and lets them go
    # before it compiles: they cost more only where they are larger than the compiled model.
    assert choice(whole_build, stored={"vae"}).kept == COMPILED
    assert choice(whole_build, stored={"vae"}, converted={"unet": 600 * MiB}).kept == COMPILED
    converted = choice(whole_build, stored={"vae"}, converted={"unet": 900 * MiB})
    assert converted.in_blocks == ("unet",) and f"--budget {whole_build + 300}MiB" in converted.notes[-1]
    # The refusal counts the build too, and says so.
    with pytest.raises(BudgetTooSmall, match=f"{300 + 100 + COMPILED_WHOLE_BUILD * 100:.2f} MiB: .*\\(with "
                       f"{COMPILED_WHOLE_BUILD}x the largest of vae more while it is built"):
        choice(350, stored=())


def test_compiled_blocks_cost_their_overhead_and_the_build_of_the_largest():
    assert compiled_blocks_extra([]) == 0
    assert compiled_blocks_extra([10 * MiB, 30 * MiB]) == int(COMPILED_BLOCK_OVERHEAD * 40 * MiB
                                                              + COMPILED_BLOCK_BUILD * 30 * MiB)


def test_the_choice_imports_nothing_that_touches_devices_or_files():
    source = (Path(__file__).parents[1] / "src" / "memfit" / "plan" / "compiled.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    # memfit.plan.meta for its activation formulas: it imports torch only inside the functions that measure modules.
    assert imported <= {"__future__", "collections.abc", "dataclasses", "memfit.plan.budget", "memfit.plan.meta", "memfit.sizes"}
