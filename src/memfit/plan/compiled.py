"""What compiled models cost a stage, and which of them a budget can keep: numbers in, a choice out.

A backend that holds its own copy of the weights (OpenVINO) turns a component into a compiled model
that cannot be streamed: it is resident whole, or it is not compiled whole. Pure, like the planner:
no torch, no devices, no files; memfit.run.fit measures and carries the choice out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from memfit.plan.budget import BudgetTooSmall
from memfit.plan.meta import activation_elements, dtype_bytes
from memfit.sizes import format_bytes, round_up_mib

__all__ = ["COMPILED_BANDS_EXTRA", "COMPILED_BLOCK_BUILD", "COMPILED_BLOCK_OVERHEAD", "COMPILED_WHOLE_BUILD", "CompiledChoice",
           "choose_compiled", "compiled_bands_extra", "compiled_blocks_extra", "decode_in_bands"]

# What a block compiled as a model of its own holds beyond its weights, as a share of them: the runtime's
# structures and buffers, intermediate buffers freed after each call (measured with openvino on the SD 1.5
# UNet's blocks in bf16: 0.35; benchmarks/openvino_budget.py, docs/openvino_budget.md).
COMPILED_BLOCK_OVERHEAD = 0.4
# What building a block that is not stored yet peaks at beyond it, as a multiple of its weights: torch.export,
# the converted and the compiled model alive together, and the torch weights it reads (mapped pages of the
# files, which a tight budget cannot leave out). Same benchmark, measured when builds were made in memory; a
# block now builds through an IR like a whole model (COMPILED_WHOLE_BUILD), so this is an upper bound.
COMPILED_BLOCK_BUILD = 3
# What building a whole compiled model that is not stored yet needs beyond the model itself, as a multiple of
# it. The build goes through an IR on disk, each step letting the one before go (memfit.compile.backends.openvino):
# with openvino on the SD 1.5 UNet in fp32 (3.20 GiB) it peaked 0.11x above the model (4.20 GiB, 0.64 GiB before;
# docs/openvino_memory.md), the most while the compiled model is exported beside pages of the IR not dropped
# yet. The torch weights it reads while converting (mapped pages of the files, 1.0x) are gone before it
# compiles. Files in another dtype than the run's are read as a converted copy, also gone before it compiles:
# the caller's ``converted``, which costs more only where it is larger than the model.
COMPILED_WHOLE_BUILD = 0.25
# What a VAE decoded in bands by compiled kernels (memfit.run.compiled_banded_decode) holds beyond its compiled
# weights and the eager banded decode's calibrated activations, as a multiple of the decode's full-resolution
# feature map (width x height x the last up block's channels, in the VAE's dtype): the kernels' own runtime
# structures, the band in flight and its copies, all of which grow with the image. Measured beside a kept compiled
# UNet: SD 1.5 fp32 512x512 (a 0.125 GiB feature map) 0.15-0.22 GiB above the eager banded figure, 1.2-1.8x;
# SDXL bf16 1024x1024 (0.25 GiB) 0.41-0.51 GiB above it, 1.6-2.0x (docs/backends.md). Counted as a share of the
# compiled VAE instead (0.75x, from the SD 1.5 point alone), SDXL's bands were planned at 0.86 GiB and peaked at
# 1.15-1.25 GiB, which made them look twice as lean as decoding whole when they saved a third.
COMPILED_BANDS_EXTRA = 2.0


def compiled_bands_extra(vae_config: Mapping, *, width: int, height: int, dtype: str) -> int:
    """Bytes the compiled band kernels hold beyond the eager banded decode's activations (COMPILED_BANDS_EXTRA
    times the decode's full-resolution feature map), for a VAE that runs in ``dtype``."""
    feature_map = activation_elements("vae_decoder_banded", vae_config, width=width, height=height) * dtype_bytes(dtype)
    return int(COMPILED_BANDS_EXTRA * feature_map)


@dataclasses.dataclass(frozen=True)
class CompiledChoice:
    """How a stage's compiled models meet its budget.

    kept:      {component: bytes} compiled whole and resident (fixed costs for the plan of the rest);
    in_blocks: components compiled block by block instead, their blocks planned like eager weights;
    dropped:   components run eagerly instead (only with --fallback eager);
    notes:     what the report says about the choice.
    """

    kept: Mapping[str, int]
    in_blocks: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def decode_in_bands(*, ceiling: int | None, already_used: int, compiled_bytes: int, plain: int,
                    banded: int | None) -> bool:
    """Whether a compiled VAE decode with no budget runs in bands (memfit.run.compiled_banded_decode) rather than
    whole: where decoding whole would lift the process above ``ceiling``, the peak it has already reached (the
    denoise stage's, measured), and the bands would lift it by less than half as much. ``already_used``: what the
    process holds as the stage starts (kept stages included); ``compiled_bytes``: the compiled decoder; ``plain``
    and ``banded``: the two decodes' planned activations (``banded`` None: the VAE cannot be decoded in bands).

    Asked only beside kept stages (memfit.run.fit): a Session that keeps the compiled denoiser loaded decodes
    beside it in bands, so the decode does not set the session's peak; a one-shot run decodes whole, as before.
    Bands cost time (every conv a call of its own, the statistics gathered first: SD 1.5 at 512x512 decodes in
    bands in 1.7x the whole decode's time), so they are chosen only for a clear saving: where both decodes would
    pass the peak by about as much (a small image, whose activations are small beside the kept denoiser), the
    decode runs whole.
    """
    if banded is None or ceiling is None:
        return False
    room = ceiling - already_used - compiled_bytes  # what the decode's activations may take under the peak
    whole_rise, banded_rise = plain - room, banded - room
    return whole_rise > 0 and banded_rise < whole_rise / 2  # bands no smaller than whole never pass this


def compiled_blocks_extra(block_bytes: Collection[int]) -> int:
    """Bytes compiled blocks of these weight sizes need beyond their weights, a build of the largest included."""
    if not block_bytes:
        return 0
    return int(COMPILED_BLOCK_OVERHEAD * sum(block_bytes) + COMPILED_BLOCK_BUILD * max(block_bytes))


def choose_compiled(*, stage: str, budget_bytes: int | None, already_used: int, compiled: Mapping[str, int],
                    stored: Collection[str] = (), converted: Mapping[str, int] | None = None,
                    blockable: Collection[str] = (), fallback_eager: bool = False) -> CompiledChoice:
    """The compiled models a stage keeps whole, those it compiles block by block, and those it runs eagerly.

    ``budget_bytes``: the stage's device budget (None: no limit); ``already_used``: what the process holds plus
    the stage's activations; ``compiled``: {component: bytes of its compiled model}; ``stored``: the components
    whose compiled model memfit's store holds already (the others are built on their first call, which costs
    COMPILED_WHOLE_BUILD x the model more, plus ``converted``: bytes of the torch weights a build reads as a
    converted copy); ``blockable``: components whose forward can be compiled block by block (denoisers and text
    encoders, on the CPU).

    All whole where they fit with the build of the largest one not stored yet; else the largest blockable ones
    are compiled in blocks until the rest fit; else, with ``fallback_eager``, the largest run eagerly; else
    BudgetTooSmall naming the smallest budget that keeps them (every one compiled, the builds counted).
    """
    converted = converted or {}

    def needed(kept: Mapping[str, int]) -> int:
        # The converted torch weights are let go before the compile (memfit.compile.backends.openvino): a build
        # peaks at the larger of them and the compiled model, plus what compiling needs beyond the model.
        builds = [COMPILED_WHOLE_BUILD * size + max(converted.get(name, 0) - size, 0) for name, size in kept.items()
                  if name not in stored]
        return already_used + sum(kept.values()) + int(max(builds, default=0))

    def fits(kept: Mapping[str, int]) -> bool:
        return budget_bytes is None or needed(kept) <= budget_bytes

    if fits(compiled):
        return CompiledChoice(dict(compiled))
    kept, in_blocks, dropped, notes = dict(compiled), [], [], []
    for name in sorted(compiled, key=compiled.get, reverse=True):
        if fits(kept):
            break
        if name in blockable:
            in_blocks.append(name)
            kept.pop(name)
    parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in kept.items())
    building = [name for name in kept if name not in stored]
    build_note = (f" (with {COMPILED_WHOLE_BUILD}x the largest of {', '.join(building)} more while it is built"
                  + (", and its torch weights converted to the run dtype" if any(n in converted for n in building) else "")
                  + ": memfit's store does not hold it yet)") if building else ""
    if not fits(kept) and not fallback_eager:
        raise BudgetTooSmall(
            budget_bytes, needed(kept),
            f"{format_bytes(already_used)} for this process and the {stage} stage's activations, plus its compiled "
            f"models, which hold their own weights and cannot be streamed ({parts}){build_note}",
            ", a narrower --precision, --fallback eager to run what does not fit eagerly, or compile fewer "
            "components (e.g. --backend unet=eager,*=openvino)")
    for name in sorted(kept, key=kept.get, reverse=True):
        if fits(kept):
            break
        dropped.append(name)
        kept.pop(name)
    if dropped:
        notes.append(
            f"{stage}: {', '.join(dropped)} run eagerly, not compiled: the compiled models ({parts}) do not fit the "
            f"budget of {format_bytes(budget_bytes)} with the {format_bytes(already_used)} that this process and the "
            f"stage's activations take{build_note} (--fallback eager)"
        )
    cold_blocks = [name for name in in_blocks
                   if name not in stored and already_used + sum(compiled.values()) <= budget_bytes]
    if cold_blocks:
        notes.append(
            f"{stage}: {', '.join(cold_blocks)} compiled in blocks: compiled whole, it fits the budget, but building it "
            f"whole needs about {COMPILED_WHOLE_BUILD}x its size more (and its torch weights in the run dtype, where "
            "its files hold another), and memfit's store does not hold it yet. A run with "
            f"--budget {round_up_mib(needed(compiled))}MiB (or none) stores it; later runs under this budget use it whole"
        )
    return CompiledChoice(kept, tuple(in_blocks), tuple(dropped), tuple(notes))
