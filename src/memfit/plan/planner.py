"""The planner: a pure function from (block sizes, activation estimates, Budget) to a Plan.

No torch, no devices, no files: it sees numbers and names only, so it is fast, deterministic
(every choice has an explicit tie-break) and testable with made-up sizes.

Model of execution the plan is made for:
  * Stages (encode, denoise, decode) run one after another; at a stage boundary the previous
    stage's weights leave the device, so each stage gets the whole device budget.
  * Within a stage a block is either **resident** (on the device for the whole stage) or
    **streamed** (copied in just before it runs and dropped after). Streaming keeps the block
    being executed plus ``prefetch`` blocks being copied in ahead of it on the device, so the
    "streaming window" is the sum of the (1 + prefetch) largest streamed blocks: the static block
    order is only approximate (see meta.py), so the window does not rely on it.
  * Every block has a **home** it is streamed from and returns to: host RAM, or disk
    (memory-mapped). Host RAM holds, while a stage runs, every host-homed block that is not
    resident on the device in that stage.

Device peak of a stage = resident bytes + streaming window + activations.

On a device with memory of its own (``staging_ring``), blocks streamed from disk pass through a
pinned staging ring in host RAM: one slot per block of the streaming window, each as large as the
largest of them. The host figure counts it, and the host budget holds it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

from memfit.plan.budget import Budget, BudgetLike, BudgetTooSmall
from memfit.sizes import format_bytes
from memfit.errors import MemfitError
from memfit.text_enum import TextEnum

__all__ = ["PLAN_FORMAT", "BlockSpec", "Plan", "Placement", "StageInput", "StagePlan", "Tier", "alternating", "host_need",
           "make_plan", "minimum_device_bytes", "phase_stages", "stage_input", "stage_plan", "staging_ring_bytes"]

#: The format version Plan.to_dict writes and Plan.from_dict reads; a change to the fields makes a new one.
PLAN_FORMAT = "memfit-plan/1"


class Tier(TextEnum):
    """Where a block's weights are: resident on the device, or streamed from host RAM or from disk."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"



@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """One block to place: the component it belongs to, its module path, its size in bytes.

    ``fixed_bytes``: the part of it the executor keeps on the device whatever its tier (a
    component's first parameter, which ``module.device`` and ``module.dtype`` read).
    """

    component: str
    name: str
    bytes: int
    fixed_bytes: int = 0

    @property
    def movable_bytes(self) -> int:
        return self.bytes - self.fixed_bytes

    @property
    def key(self) -> str:
        return f"{self.component}/{self.name}"


@dataclasses.dataclass(frozen=True)
class StageInput:
    """A stage to plan: its blocks in (static) execution order and its peak activation bytes.

    ``runs`` is how many forward passes the stage makes (denoise: one per step, or two with
    unbatched guidance); it only decides which streamed blocks deserve host RAM over disk.
    ``homed``: components whose blocks keep their home while resident (a phase's, which goes back to its
    home when the next phase comes in: on a device with memory of its own that home is host RAM the
    stage holds).
    """

    name: str
    blocks: tuple[BlockSpec, ...]
    activation_bytes: int
    runs: int = 1
    homed: tuple[str, ...] = ()


def alternating(members: Iterable[str], names: Iterable[str]) -> tuple[str, ...]:
    """Of ``members`` (components that run one at a time, in the order they run: Wan 2.2's experts), those among
    ``names``, where two or more are; else none, and the stage is planned as any stage is."""
    names = set(names)
    present = tuple(name for name in members if name in names)
    return present if len(present) > 1 else ()


def phase_stages(stage: str, names: Iterable[str],
                 phases: Sequence[str]) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """The stages to plan for ``stage`` with components ``names``, each (name, components, homed: its
    StageInput's ``homed``): with ``phases`` (alternating), one per phase, "STAGE:PHASE", holding the components
    that are no phase and that phase (homed), so the stage needs the largest phase, not their sum; else
    ``stage`` itself with every component."""
    names = list(names)
    if not phases:
        return [(stage, names, ())]
    common = [name for name in names if name not in phases]
    return [(f"{stage}:{phase}", [*common, phase], (phase,)) for phase in phases]


def stage_input(name: str, components: Iterable, activation_bytes: int, runs: int = 1,
                homed: tuple[str, ...] = ()) -> StageInput:
    """Build a StageInput from measured components (anything with ``.name`` and ``.blocks`` whose
    items have ``.name`` and ``.bytes``, such as meta.ComponentSize), keeping their block order. The largest
    dequantization scratch of its components (``scratch_bytes``) is held beside the activations."""
    components = list(components)
    blocks = tuple(BlockSpec(c.name, b.name, b.bytes) for c in components for b in c.blocks)
    scratch = max((getattr(c, "scratch_bytes", 0) for c in components), default=0)
    return StageInput(name=name, blocks=blocks, activation_bytes=activation_bytes + scratch, runs=runs, homed=homed)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one block executes from in one stage: Tier.DEVICE (resident), Tier.HOST or Tier.DISK (streamed)."""

    component: str
    block: str
    bytes: int
    where: Tier


@dataclasses.dataclass(frozen=True)
class StagePlan:
    name: str
    placements: tuple[Placement, ...]  # in the stage's block order
    activation_bytes: int
    resident_bytes: int
    streamed_from_host_bytes: int
    streamed_from_disk_bytes: int
    stream_window_bytes: int
    peak_bytes: int

    def blocks_at(self, where: Tier) -> tuple[str, ...]:
        return tuple(f"{p.component}/{p.block}" for p in self.placements if p.where == where)

    @property
    def resident(self) -> tuple[str, ...]:
        return self.blocks_at(Tier.DEVICE)

    @property
    def from_host(self) -> tuple[str, ...]:
        return self.blocks_at(Tier.HOST)

    @property
    def from_disk(self) -> tuple[str, ...]:
        return self.blocks_at(Tier.DISK)

    @property
    def largest_streamed_bytes(self) -> int:
        """The biggest block streamed in this stage (0 if none): what one running block adds."""
        return max((p.bytes for p in self.placements if p.where != Tier.DEVICE), default=0)


@dataclasses.dataclass(frozen=True)
class Plan:
    budget: Budget
    prefetch: int
    stages: tuple[StagePlan, ...]
    # (block key, Tier.HOST or Tier.DISK) for every block, in first-use order: where a block is read
    # from when it streams or when its stage starts, and where it goes back when not in use.
    homes: tuple[tuple[str, Tier], ...]
    host_peak_bytes: int  # most host RAM the parked weights (and a staging ring) need at any stage

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.stages), default=0)

    def stage(self, name: str) -> StagePlan:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise MemfitError(f"The plan has no stage {name!r}; it has {[s.name for s in self.stages]}.")

    def home_of(self, key: str) -> Tier:
        for block, home in self.homes:
            if block == key:
                return home
        raise MemfitError(f"The plan has no block {key!r}; keys look like 'unet/down_blocks.0'.")

    def to_dict(self) -> dict:
        """Plain JSON-serializable data (ints, strings, lists, dicts), with its "format" (PLAN_FORMAT)."""
        data = {"format": PLAN_FORMAT, **dataclasses.asdict(self)}
        data["peak_bytes"] = self.peak_bytes
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The Plan that ``to_dict`` wrote ``data`` from (also after a JSON round trip), or the one in a
        ``memfit plan --json`` report (its "plan"). Raises MemfitError for a plan of another format
        version, and for a missing key or a value of the wrong type, naming the key."""
        if isinstance(data, Mapping) and "format" not in data and isinstance(data.get("plan"), Mapping):
            data = data["plan"]
        saved = _Saved(data, "")
        found = data.get("format")
        if found != PLAN_FORMAT:
            written = f"format {found!r}" if found is not None else 'no "format" key (an older memfit wrote it)'
            raise MemfitError(
                f"This plan has {written}, but this memfit reads plans of format {PLAN_FORMAT!r}; make the plan "
                "again with this memfit: `memfit plan ... --json`."
            )
        budget = saved.object("budget")
        stages = tuple(
            _read(StagePlan, stage, placements=tuple(_read(Placement, p) for p in stage.objects("placements")))
            for stage in saved.objects("stages")
        )
        return _read(cls, saved, stages=stages, homes=saved.pairs("homes"),
                     budget=Budget(device=budget.get("device", int, optional=True),
                                   host=budget.get("host", int, optional=True),
                                   disk=budget.get("disk", str, optional=True)))

    def table(self) -> str:
        return _render_table(self)


# --- reading a saved plan ---------------------------------------------------------------------


class _Saved:
    """One JSON object of a saved plan. Every read names the key (``stages[0].placements[2].where``)
    when it is missing or holds a value of the wrong type, instead of a KeyError or TypeError."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            if not path:
                raise MemfitError(f"A saved plan is a JSON object (as Plan.to_dict or `memfit plan --json` writes it), "
                                  f"not {_shown(data)}.")
            raise _malformed(path, f"is {_shown(data)}, not a JSON object")
        self.data = data
        self.path = path

    def key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type, *, optional: bool = False) -> Any:
        if key not in self.data:
            raise _malformed(self.key(key), "is missing")
        return _checked(self.data[key], kind, self.key(key), optional)

    def object(self, key: str) -> "_Saved":
        return _Saved(self.get(key, object), self.key(key))  # which refuses a non-object, naming the key

    def objects(self, key: str) -> list["_Saved"]:
        return [_Saved(item, f"{self.key(key)}[{i}]") for i, item in enumerate(self.get(key, list))]

    def pairs(self, key: str) -> tuple[tuple[str, Tier], ...]:
        """``[[block key, tier], ...]`` (Plan.homes) as a tuple of pairs."""
        pairs = []
        for i, pair in enumerate(self.get(key, list)):
            path = f"{self.key(key)}[{i}]"
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise _malformed(path, f"is {_shown(pair)}, not a [block, tier] pair")
            pairs.append((_checked(pair[0], str, f"{path}[0]"), _checked(pair[1], Tier, f"{path}[1]")))
        return tuple(pairs)


_TIER_VALUES = [tier.value for tier in Tier]
_KINDS = {int: "an integer", str: "a string", list: "a list", Tier: "one of " + ", ".join(map(repr, _TIER_VALUES))}


def _checked(value: Any, kind: type, path: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if kind is Tier:
        if isinstance(value, str) and value in _TIER_VALUES:
            return Tier(value)
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise _malformed(path, f"is {_shown(value)}, not {_KINDS[kind]}" + (" or null" if optional else ""))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read(cls, saved: _Saved, **given):
    """An instance of the dataclass ``cls``: the fields in ``given`` as given, the others (int, str and
    Tier fields) read from ``saved`` by name."""
    kinds = {"int": int, "str": str, "Tier": Tier}
    return cls(**{field.name: given[field.name] if field.name in given else saved.get(field.name, kinds[field.type])
                  for field in dataclasses.fields(cls)})


def _malformed(path: str, what: str) -> MemfitError:
    return MemfitError(f"The plan's {path!r} {what}; make the plan again with `memfit plan ... --json`.")


# --- planning ---------------------------------------------------------------------------------


def make_plan(stages: Sequence[StageInput], budget: BudgetLike, *, prefetch: int = 1,
              staging_ring: bool = False) -> Plan:
    """Decide, per stage, which blocks stay on the device and where the others stream from.

    Device residency, per stage, greedy "first fit decreasing": blocks are taken largest first
    (ties: earlier in the stage first) and each is kept resident if resident bytes + that block +
    the streaming window of the blocks still streamed + activations fit the device budget.
    Largest first because every streamed byte is copied once per forward whatever block it
    belongs to, and keeping big blocks resident also shrinks the streaming window.

    Homes: blocks are offered host RAM in order of how often they are read from their home
    (``runs`` of each stage where they stream, 1 where they are resident), ties in first-use
    order, each kept on the host if the host need stays within budget.host; the rest live on
    disk, which needs ``budget.disk``. ``staging_ring``: the disk tier streams through a pinned ring
    in host RAM (on a GPU), counted in the host need (staging_ring_bytes).

    Raises MemfitError naming the smallest device (or host) budget that would work when nothing
    does.
    """
    budget = Budget.of(budget)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise MemfitError(f"prefetch must be an int >= 0 (blocks copied ahead), got {prefetch!r}.")
    _validate(stages)
    device_capacity = math.inf if budget.device is None else budget.device

    _check_device_fits(stages, budget, prefetch)
    resident_per_stage = [_choose_resident(stage, device_capacity, prefetch) for stage in stages]
    # What each stage holds in host RAM besides what it does not keep resident: on a device with memory of its
    # own, a phase's resident blocks keep their home too (they go back to it when the next phase comes in).
    off_host = resident_per_stage if not staging_ring else [
        frozenset(key for key in resident if key.split("/")[0] not in stage.homed)
        for stage, resident in zip(stages, resident_per_stage)]
    homes = _choose_homes(stages, resident_per_stage, budget, 1 + prefetch if staging_ring else 0, off_host)

    stage_plans = tuple(
        stage_plan(stage, resident, homes, prefetch) for stage, resident in zip(stages, resident_per_stage)
    )
    host_keys = [key for key, home in homes.items() if home == Tier.HOST]
    return Plan(
        budget=budget,
        prefetch=prefetch,
        stages=stage_plans,
        homes=tuple(homes.items()),
        host_peak_bytes=host_need(host_keys, _block_sizes(stages), off_host)
        + (staging_ring_bytes(stage_plans, prefetch) if staging_ring else 0),
    )


def staging_ring_bytes(stage_plans: Iterable[StagePlan], prefetch: int) -> int:
    """The pinned staging ring blocks streamed from disk pass through on a device with memory of its own:
    (1 + prefetch) slots, each as large as the largest block streamed from disk (at the run dtype)."""
    return (1 + prefetch) * max((p.bytes for s in stage_plans for p in s.placements if p.where == Tier.DISK),
                                default=0)


def _validate(stages: Sequence[StageInput]) -> None:
    if not stages:
        raise MemfitError("Nothing to plan: no stages were given.")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise MemfitError(f"Stage names must be unique, got {names}.")
    sizes: dict[str, int] = {}
    for stage in stages:
        if stage.activation_bytes < 0 or stage.runs < 1:
            raise MemfitError(
                f"Stage {stage.name!r}: activation_bytes must be >= 0 and runs >= 1, "
                f"got {stage.activation_bytes} and {stage.runs}."
            )
        keys = [b.key for b in stage.blocks]
        if len(set(keys)) != len(keys):
            raise MemfitError(f"Stage {stage.name!r} lists a block twice; block keys must be unique per stage.")
        for block in stage.blocks:
            if block.bytes < 0:
                raise MemfitError(f"Block {block.key} has a negative size ({block.bytes}).")
            # A block shared by stages (one VAE used twice) must be the same size everywhere.
            if sizes.setdefault(block.key, block.bytes) != block.bytes:
                raise MemfitError(
                    f"Block {block.key} has size {sizes[block.key]} in one stage and {block.bytes} in "
                    f"stage {stage.name!r}; measure shared components once, at one dtype."
                )


def _window(sizes: Iterable[int], prefetch: int) -> int:
    return sum(sorted(sizes, reverse=True)[: 1 + prefetch])


def minimum_device_bytes(stage: StageInput, prefetch: int = 1) -> int:
    """The smallest device budget ``stage`` can be planned in (every block streamed)."""
    return _minimum_device(stage, prefetch)


def _minimum_device(stage: StageInput, prefetch: int) -> int:
    """Smallest device budget for the stage: stream everything, only the window is on the device."""
    return (stage.activation_bytes + _window((b.movable_bytes for b in stage.blocks), prefetch)
            + sum(b.fixed_bytes for b in stage.blocks))


def _check_device_fits(stages: Sequence[StageInput], budget: Budget, prefetch: int) -> None:
    if budget.device is None:
        return
    short = [s for s in stages if _minimum_device(s, prefetch) > budget.device]
    if not short:
        return
    needed = max(_minimum_device(s, prefetch) for s in stages)
    worst = max(short, key=lambda s: _minimum_device(s, prefetch))
    largest = sorted((b for b in worst.blocks), key=lambda b: -b.bytes)[: 1 + prefetch]
    in_flight = " + ".join(f"{b.key} {format_bytes(b.bytes)}" for b in largest) or "no blocks"
    raise BudgetTooSmall(
        budget.device, needed,
        f"the {worst.name} stage with every weight streamed, activations {format_bytes(worst.activation_bytes)} + "
        f"blocks in flight: {in_flight}", ", or lower the resolution, batch or dtype width")


def _choose_resident(stage: StageInput, capacity: float, prefetch: int) -> frozenset[str]:
    order = sorted(range(len(stage.blocks)), key=lambda i: (-stage.blocks[i].bytes, i))
    resident: set[str] = set()
    resident_bytes = 0
    for i in order:
        block = stage.blocks[i]
        streamed_after = [b for b in stage.blocks if b.key not in resident and b.key != block.key]
        need = (resident_bytes + block.bytes + _window((b.movable_bytes for b in streamed_after), prefetch)
                + sum(b.fixed_bytes for b in streamed_after) + stage.activation_bytes)
        if need <= capacity:
            resident.add(block.key)
            resident_bytes += block.bytes
    return frozenset(resident)


def _block_sizes(stages: Sequence[StageInput]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for stage in stages:
        for block in stage.blocks:
            sizes.setdefault(block.key, block.bytes)  # insertion order = first use
    return sizes


def host_need(host_keys: Iterable[str], sizes: dict[str, int], resident_per_stage) -> int:
    keys = list(host_keys)
    return max((sum(sizes[k] for k in keys if k not in resident) for resident in resident_per_stage), default=0)


def _choose_homes(stages, resident_per_stage, budget: Budget, ring_slots: int = 0, off_host=None) -> dict[str, Tier]:
    """Each block's home (see make_plan); ``off_host``: per stage, the resident blocks that hold no host RAM
    (default: every resident block)."""
    off_host = resident_per_stage if off_host is None else off_host
    sizes = _block_sizes(stages)
    reads = dict.fromkeys(sizes, 0)
    streamed: set[str] = set()
    for stage, resident in zip(stages, resident_per_stage):
        for block in stage.blocks:
            reads[block.key] += 1 if block.key in resident else stage.runs
            if block.key not in resident:
                streamed.add(block.key)
    first_use = {key: index for index, key in enumerate(sizes)}
    capacity = math.inf if budget.host is None else budget.host

    homes: dict[str, Tier] = {}
    on_host: list[str] = []
    for key in sorted(sizes, key=lambda k: (-reads[k], first_use[k])):
        if host_need(on_host + [key], sizes, off_host) <= capacity:
            on_host.append(key)
            homes[key] = Tier.HOST
        else:
            homes[key] = Tier.DISK

    spilled = [k for k, home in homes.items() if home == Tier.DISK]
    if spilled and budget.disk is None:
        needed = host_need(sizes, sizes, off_host)
        raise MemfitError(
            f"The host budget of {format_bytes(budget.host or 0)} cannot hold the weights parked off the "
            f"device ({len(spilled)} blocks, e.g. {spilled[0]}, do not fit) and no disk directory was "
            f"given. Raise the host budget to at least {needed} bytes ({format_bytes(needed)}), or give a "
            "disk tier, e.g. Budget(device=..., host=..., disk='/var/tmp/memfit')."
        )

    def ring() -> int:
        return ring_slots * max((sizes[k] for k in streamed if homes[k] == Tier.DISK), default=0)

    # The staging ring of the blocks that went to disk takes host RAM too: the least read blocks kept
    # leave the host until both fit.
    while ring() and host_need(on_host, sizes, off_host) + ring() > capacity:
        if not on_host:
            raise MemfitError(
                f"The host budget of {format_bytes(budget.host or 0)} cannot hold the pinned staging ring the disk "
                f"tier streams through ({format_bytes(ring())}: {ring_slots} slots of the largest block streamed). "
                f"Raise the host budget to at least {ring()} bytes ({format_bytes(ring())}), or give a larger "
                "device budget."
            )
        homes[on_host.pop()] = Tier.DISK
    return {key: homes[key] for key in sizes}  # first-use order, for stable output


def stage_plan(stage: StageInput, resident: frozenset[str], homes: dict[str, Tier], prefetch: int) -> StagePlan:
    placements = tuple(
        Placement(b.component, b.name, b.bytes, Tier.DEVICE if b.key in resident else homes[b.key])
        for b in stage.blocks
    )
    by_where = dict.fromkeys(Tier, 0)
    for block, p in zip(stage.blocks, placements):
        by_where[p.where] += block.movable_bytes
        by_where[Tier.DEVICE] += block.fixed_bytes  # resident whatever the block's tier
    window = _window((b.movable_bytes for b, p in zip(stage.blocks, placements) if p.where != Tier.DEVICE), prefetch)
    return StagePlan(
        name=stage.name,
        placements=placements,
        activation_bytes=stage.activation_bytes,
        resident_bytes=by_where[Tier.DEVICE],
        streamed_from_host_bytes=by_where[Tier.HOST],
        streamed_from_disk_bytes=by_where[Tier.DISK],
        stream_window_bytes=window,
        peak_bytes=by_where[Tier.DEVICE] + window + stage.activation_bytes,
    )


# --- rendering --------------------------------------------------------------------------------


def _render_table(plan: Plan) -> str:
    b = plan.budget
    lines = [
        "memfit plan: device budget {}, host {}, disk {}, prefetch {}".format(
            "unlimited" if b.device is None else format_bytes(b.device),
            "unlimited" if b.host is None else format_bytes(b.host),
            b.disk or "none",
            plan.prefetch,
        ),
        "",
    ]
    header = ("stage", "component", "on device", "streamed from host", "streamed from disk")
    rows = [header]
    for stage in plan.stages:
        for component in dict.fromkeys(p.component for p in stage.placements):
            cells = [stage.name, component]
            for where in Tier:
                chosen = [p for p in stage.placements if p.component == component and p.where == where]
                total = sum(p.bytes for p in stage.placements if p.component == component)
                cells.append(_cell(chosen, total))
            rows.append(tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    for stage in plan.stages:
        lines.append(
            f"{stage.name}: peak {format_bytes(stage.peak_bytes)} = resident {format_bytes(stage.resident_bytes)}"
            f" + streaming window {format_bytes(stage.stream_window_bytes)}"
            f" + activations {format_bytes(stage.activation_bytes)}"
        )
    lines.append(f"host RAM for parked weights: {format_bytes(plan.host_peak_bytes)} at most")
    return "\n".join(lines)


def _cell(chosen: Sequence[Placement], component_total: int) -> str:
    if not chosen:
        return "-"
    size = sum(p.bytes for p in chosen)
    return f"{len(chosen)} blk {format_bytes(size)} ({100 * size / max(component_total, 1):.0f}%)"
