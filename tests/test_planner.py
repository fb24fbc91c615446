"""The planner on made-up sizes: residency, streaming window, homes, errors, determinism, purity."""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

import pytest

from memfit.plan.budget import Budget
from memfit.errors import MemfitError
from memfit.plan.planner import PLAN_FORMAT, BlockSpec, Plan, StageInput, Tier, make_plan, stage_input


def stage(name, sizes, activations=0, component="m", runs=1):
    blocks = tuple(BlockSpec(component, f"b{i}", size) for i, size in enumerate(sizes))
    return StageInput(name, blocks, activations, runs)


def check_invariants(plan: Plan, stages):
    """What must hold for any plan, whatever the greedy chose."""
    for planned, given in zip(plan.stages, stages):
        sizes = {b.key: b.bytes for b in given.blocks}
        assert sorted(planned.resident + planned.from_host + planned.from_disk) == sorted(sizes)
        streamed = sorted((sizes[k] for k in planned.from_host + planned.from_disk), reverse=True)
        window = sum(streamed[: 1 + plan.prefetch])
        resident = sum(sizes[k] for k in planned.resident)
        assert planned.stream_window_bytes == window
        assert planned.peak_bytes == resident + window + given.activation_bytes
        if plan.budget.device is not None:
            assert planned.peak_bytes <= plan.budget.device
            # Greedy is maximal: no streamed block could also have stayed resident.
            for key in planned.from_host + planned.from_disk:
                rest = sorted((sizes[k] for k in planned.from_host + planned.from_disk if k != key), reverse=True)
                grown = resident + sizes[key] + sum(rest[: 1 + plan.prefetch]) + given.activation_bytes
                assert grown > plan.budget.device
    if plan.budget.host is not None:
        assert plan.host_peak_bytes <= plan.budget.host


def test_everything_resident_when_it_fits():
    stages = [stage("denoise", [30, 20, 10], activations=5)]
    plan = make_plan(stages, Budget(device=1000))
    s = plan.stage("denoise")
    assert s.from_host == s.from_disk == ()
    assert s.peak_bytes == 65 and s.stream_window_bytes == 0
    check_invariants(plan, stages)


def test_partial_residency_keeps_largest_blocks_and_streams_the_rest():
    # 100 + 50 resident = 150, window = 40 + 30 (one running, one prefetched), activations 10: 230.
    stages = [stage("denoise", [40, 100, 30, 50, 20], activations=10)]
    plan = make_plan(stages, 230)
    s = plan.stage("denoise")
    assert s.resident == ("m/b1", "m/b3")
    assert s.from_host == ("m/b0", "m/b2", "m/b4")  # in execution order
    assert s.peak_bytes == 230
    check_invariants(plan, stages)


def test_unlimited_device_keeps_everything():
    plan = make_plan([stage("s", [5, 6])], Budget())
    assert plan.stage("s").resident == ("m/b0", "m/b1")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_too_small_budget_names_the_smallest_that_works(prefetch):
    stages = [
        stage("encode", [10, 10], activations=1, component="te"),
        stage("denoise", [70, 60, 50, 5], activations=20, component="unet"),
    ]
    with pytest.raises(MemfitError) as info:
        make_plan(stages, 50, prefetch=prefetch)
    message = str(info.value)
    assert "the denoise stage" in message
    smallest = int(message.split("smallest budget that works is ")[1].split(" bytes")[0])
    check_invariants(make_plan(stages, smallest, prefetch=prefetch), stages)  # exactly enough works
    with pytest.raises(MemfitError):
        make_plan(stages, smallest - 1, prefetch=prefetch)  # and it really is the smallest


@pytest.mark.parametrize("device", range(92, 320, 7))  # 92: the denoise stage fully streamed
def test_invariants_hold_across_budgets(device):
    stages = [
        stage("encode", [25, 5, 5, 5], activations=3, component="te"),
        stage("denoise", [40, 10, 33, 17, 17, 8, 40], activations=12, component="unet", runs=20),
        stage("decode", [9, 9, 4], activations=30, component="vae"),
    ]
    check_invariants(make_plan(stages, Budget(device=device)), stages)


def test_more_device_never_means_less_resident():
    stages = [stage("denoise", [40, 10, 33, 17, 17, 8, 40], activations=12)]
    resident = [make_plan(stages, d).stage("denoise").resident_bytes for d in range(100, 200, 3)]
    assert resident == sorted(resident)


def test_host_goes_to_blocks_read_most_often_and_the_rest_to_disk():
    encode = stage("encode", [50, 50], component="te")  # resident in its stage: read once per generation
    denoise = stage("denoise", [50, 50, 50], component="unet", runs=30)  # streamed every step
    budget = Budget(device=100, host=150, disk="/var/tmp/memfit")
    plan = make_plan([encode, denoise], budget)
    assert set(plan.stage("denoise").from_host) | set(plan.stage("denoise").resident) == {"unet/b0", "unet/b1", "unet/b2"}
    assert plan.stage("denoise").from_host == ("unet/b0", "unet/b1", "unet/b2")
    # The text encoder lost the host to the denoiser: it is loaded from disk when encode starts.
    assert plan.stage("encode").resident == ("te/b0", "te/b1")
    assert plan.home_of("te/b0") == plan.home_of("te/b1") == "disk"
    check_invariants(plan, [encode, denoise])


def test_without_disk_tier_a_small_host_is_an_error_naming_the_host_needed():
    stages = [stage("encode", [50, 50], component="te"), stage("denoise", [50, 50, 50], component="unet")]
    with pytest.raises(MemfitError) as info:
        make_plan(stages, Budget(device=100, host=60))
    message = str(info.value)
    assert "disk" in message
    needed = int(message.split("at least ")[1].split(" bytes")[0])
    plan = make_plan(stages, Budget(device=100, host=needed))
    assert all(not s.from_disk for s in plan.stages)
    with pytest.raises(MemfitError):
        make_plan(stages, Budget(device=100, host=needed - 1))


def test_a_staging_ring_is_counted_in_the_host_figure_and_held_by_the_host_budget():
    """Issue 34, item 7: on a GPU the blocks streamed from disk pass through a pinned ring of (1 + prefetch)
    slots of the largest of them, in host RAM: the host figure counts it and the host budget holds it (the
    least read host blocks go to disk until it does); where everything fits on the host there is no ring."""
    denoise = stage("denoise", [50, 50, 50, 50], runs=30)
    disk = "/var/tmp/memfit"
    # Device 100: every block streams. Host 150 holds b0..b2 (150) and b3 goes to disk, with a ring of 2 x 50.
    without = make_plan([denoise], Budget(device=100, host=150, disk=disk))
    assert without.stage("denoise").from_disk == ("m/b3",) and without.host_peak_bytes == 150
    tight = make_plan([denoise], Budget(device=100, host=150, disk=disk), staging_ring=True)
    assert tight.stage("denoise").from_disk == ("m/b1", "m/b2", "m/b3") and tight.host_peak_bytes == 50 + 2 * 50
    whole = make_plan([denoise], Budget(device=100, host=200, disk=None), staging_ring=True)
    assert not whole.stage("denoise").from_disk and whole.host_peak_bytes == 200
    with pytest.raises(MemfitError, match="cannot hold the pinned staging ring .* at least 100 bytes"):
        make_plan([denoise], Budget(device=100, host=99, disk=disk), staging_ring=True)
    check_invariants(tight, [denoise])


def test_shared_block_is_counted_once_on_the_host():
    vae = BlockSpec("vae", "decoder", 10)
    stages = [StageInput("a", (BlockSpec("te", "x", 5), vae), 0), StageInput("b", (vae,), 0)]
    plan = make_plan(stages, Budget(device=100, host=100))
    # While "a" runs nothing is parked; while "b" runs only te/x (5) is: vae is resident there.
    assert plan.host_peak_bytes == 5


def test_plan_is_deterministic_and_ties_go_to_earlier_blocks():
    stages = [stage("denoise", [10] * 8, activations=1)]
    plans = [make_plan(stages, 51) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    assert plans[0].stage("denoise").resident == ("m/b0", "m/b1", "m/b2")


def test_block_order_does_not_change_what_fits():
    sizes = [40, 10, 33, 17, 8]
    peaks = {
        make_plan([stage("s", list(order), activations=5)], 90).stage("s").resident_bytes
        for order in itertools.permutations(sizes)
    }
    assert len(peaks) == 1


def test_to_dict_is_json_and_table_names_stages_and_components():
    stages = [stage("encode", [5, 5], component="text_encoder"), stage("denoise", [30, 20, 10], component="unet", activations=4)]
    plan = make_plan(stages, Budget(device=60, host=None))
    data = json.loads(json.dumps(plan.to_dict()))
    assert [s["name"] for s in data["stages"]] == ["encode", "denoise"]
    assert data["budget"] == {"device": 60, "host": None, "disk": None}
    assert data["peak_bytes"] == plan.peak_bytes
    assert [key for key, _home in data["homes"]] == ["text_encoder/b0", "text_encoder/b1", "unet/b0", "unet/b1", "unet/b2"]
    table = plan.table()
    for word in ("encode", "denoise", "text_encoder", "unet", "peak"):
        assert word in table


def saved_plan() -> Plan:
    """A plan with a block on every tier, a shared block and a budget of every kind."""
    encode = stage("encode", [50, 50], component="te")
    denoise = stage("denoise", [50, 50, 50], component="unet", runs=30)
    return make_plan([encode, denoise], Budget(device=110, host=60, disk="/var/tmp/memfit"))


def test_from_dict_reads_back_what_to_dict_wrote_through_json():
    plan = saved_plan()
    assert {p.where for s in plan.stages for p in s.placements} == set(Tier)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["format"] == PLAN_FORMAT
    again = Plan.from_dict(data)
    assert again == plan and again.to_dict() == plan.to_dict()
    assert all(isinstance(p.where, Tier) for s in again.stages for p in s.placements)
    assert Plan.from_dict({"arch": "x", "plan": data}) == plan  # a `memfit plan --json` report


@pytest.mark.parametrize("written, says", [("memfit-plan/0", "format 'memfit-plan/0'"),
                                           (None, 'no "format" key')])
def test_a_plan_of_another_format_version_is_refused_saying_what_to_do(written, says):
    data = saved_plan().to_dict()
    if written is None:
        del data["format"]
    else:
        data["format"] = written
    with pytest.raises(MemfitError) as info:
        Plan.from_dict(data)
    message = str(info.value)
    assert says in message and f"reads plans of format {PLAN_FORMAT!r}" in message
    assert "memfit plan ... --json" in message


MISSING = object()


@pytest.mark.parametrize("path, value, says", [
    (("stages", 1, "placements", 2, "where"), MISSING, "'stages[1].placements[2].where' is missing"),
    (("budget",), MISSING, "'budget' is missing"),
    (("stages", 0, "peak_bytes"), "12", "'stages[0].peak_bytes' is '12', not an integer"),
    (("prefetch",), True, "'prefetch' is True, not an integer"),
    (("stages", 0, "placements", 0, "where"), "gpu", "is 'gpu', not one of 'device', 'host', 'disk'"),
    (("homes", 0), ["te/b0"], "'homes[0]' is ['te/b0'], not a [block, tier] pair"),
    (("stages",), {}, "'stages' is {}, not a list"),
    (("stages", 0, "placements"), [1], "'stages[0].placements[0]' is 1, not a JSON object"),
    (("budget", "host"), "60", "'budget.host' is '60', not an integer or null"),
])
def test_malformed_plans_are_refused_naming_the_key(path, value, says):
    data = json.loads(json.dumps(saved_plan().to_dict()))
    *parents, last = path
    inner = data
    for key in parents:
        inner = inner[key]
    if value is MISSING:
        del inner[last]
    else:
        inner[last] = value
    with pytest.raises(MemfitError) as info:
        Plan.from_dict(data)
    assert says in str(info.value) and "memfit plan ... --json" in str(info.value)
    with pytest.raises(MemfitError, match="A saved plan is a JSON object"):
        Plan.from_dict([data])


def test_stage_input_reads_measured_components():
    class Block:
        def __init__(self, name, size):
            self.name, self.bytes = name, size

    class Component:
        name = "unet"
        blocks = (Block("down_blocks.0", 3), Block("rest", 4))

    built = stage_input("denoise", [Component()], activation_bytes=7, runs=3)
    assert built.blocks == (BlockSpec("unet", "down_blocks.0", 3), BlockSpec("unet", "rest", 4))
    assert (built.activation_bytes, built.runs) == (7, 3)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([], "no stages"),
        ([stage("a", [1]), stage("a", [2])], "unique"),
        ([stage("a", [-1])], "negative"),
        ([stage("a", [1], activations=-1)], "activation"),
        ([StageInput("a", (BlockSpec("m", "x", 1),), 0), StageInput("b", (BlockSpec("m", "x", 2),), 0)], "one dtype"),
    ],
)
def test_invalid_stages_are_rejected(stages, message):
    with pytest.raises(MemfitError, match=message):
        make_plan(stages, 100)


def test_bad_prefetch_and_budget_are_rejected():
    with pytest.raises(MemfitError, match="prefetch"):
        make_plan([stage("a", [1])], 100, prefetch=-1)
    with pytest.raises(MemfitError):
        make_plan([stage("a", [1])], "a lot")


def test_planner_module_imports_nothing_that_touches_devices_or_files():
    source = (Path(__file__).parents[1] / "src" / "memfit" / "plan" / "planner.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported <= {"__future__", "dataclasses", "math", "typing", "memfit.plan.budget", "memfit.errors", "memfit.sizes",
                        "memfit.text_enum"}
