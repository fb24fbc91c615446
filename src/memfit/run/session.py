"""A session: one model folder and one set of run options, generating image after image with the
stages kept loaded (fitted and compiled) between runs while the budget allows it.

memfit.generate loads, fits, runs and releases each stage per call. A session runs the very same
stages through the same runner (memfit.generate with ``pool=``); the only difference is the run's
pool (WarmPool, a memfit.run.options.StagePool): a stage hands its fitted pipeline to the pool instead of dropping it, and
the next run's stage takes it back instead of loading, planning and compiling again. The images
are the same as memfit.generate's, bit for bit (tests/test_serve.py holds the server to that).

A compiled VAE decodes in bands (memfit.run.compiled_banded_decode) where decoding it whole does not fit beside
the kept stages (with no budget: where it would lift the process above the peak it already reached and the
bands clearly less): bounded, the decode runs beside the kept compiled denoiser instead of making the pool let
it go. Where even the bands do not fit, the pool first lets the smallest kept pipelines go (a text encoder before
the denoiser: WarmPool.release_smallest, counted in ``released``, named in the run's notes), keeps the rest, and
loads the stages it let go per run from then on; the decode then runs whole where that fits in the room they left
(faster than in bands). With no budget it never lets the largest go.

The rule that keeps a session inside the budget: a stage's plan is made with the memory the process
holds at the time, warm stages included, so nothing is ever planned past the budget. Stages are
kept warm only while every stage fits fully resident that way; the first stage that would have to
stream weights because others are kept makes the pool release them and plan that stage as a one-shot
run would, and from then on the session runs like memfit.generate (releasing every stage), which
the pool's ``gave_up`` says and the session's ``warm_state`` reports. A stage that cannot be planned
at all beside the kept ones (memfit.plan.budget.StageDoesNotFit) is handled the same way. A kept stage
runs every later image as its plan decided (the pool keeps its StageFit): chunked attention or a split
batch where that is what fitted the budget, the heap for temporaries where the plan counted it.

Compiled models (OpenVINO) also keep their intermediate buffers between calls, so that the next image
need not allocate and fault them in again (SDXL's decode at 1024x1024: 1.0 s). Under a budget the pool
lets them go before they could crowd a stage: before any stage is planned (so its plan sees only the
kept weights), and before a warm stage runs unless the memory in use plus the most that stage has grown
by in an earlier run fits the budget (WarmPool.make_room).

A kept pipeline is reused only for what it was made for: the same task (pipeline class, ControlNet,
LoRAs) and, under a budget, the same sizes its plan assumed; anything else releases it and fits the
stage again, so no stage is ever held twice. memfit serve and memfit batch (its local driver and
every Ray worker) run their images through a Session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.compile.entry_points import release_buffers
from memfit.run.executor import KeptHostTiers
from memfit.run.generate import generate
from memfit.run.memory import release_freed_memory
from memfit.run.options import default_device
from memfit.run.runner import resident_bytes
from memfit.run.stages import Generation, open_model
from memfit.run.threads import check_threads

__all__ = ["Interrupted", "Session", "WarmPool"]


class Interrupted(Exception):
    """A run stopped at a stage's start or between two denoising steps because its caller asked (Session.generate's
    on_step)."""


class WarmPool:
    """Stage pipelines kept loaded between runs: one per slot (folder, components, plan, label), with
    what it was made for (task, LoRAs and, under a budget, the sizes planned for: StageContext.load)."""

    def __init__(self) -> None:
        # slot -> (made_for, pipe, fit): the pipe with what it was made for and what fitting it decided (StageFit: its
        # strategy and heap, which each of its runs applies again)
        self._pipes: dict[tuple, tuple[tuple, Any, Any]] = {}
        self.gave_up = ""  # why the pool stopped keeping stages (empty while it keeps them)
        # stage -> the most its memory grew by while it ran, measured since it last loaded a pipeline
        # (that run's growth counts the loading too: an over-estimate for a warm run, never an under-one)
        self._growth: dict[str, int] = {}
        # On a GPU, the pinned host tiers of the stages that stream, kept filled for their next run (even where
        # the pipelines themselves are not kept: a stage that streams takes the device's room).
        self.host_tiers = KeptHostTiers()
        # Stages fitted to run in bounded memory beside the kept ones (a compiled decode in bands): they run beside
        # the kept weights only, so the kept compiled models' buffers are freed before each of their runs.
        self.bounded: set[str] = set()
        self.released = 0  # kept pipelines let go to make room for a stage while the pool went on keeping the rest
        self.let_go: list[str] = []  # their components, as stage:component
        self._not_kept: set[tuple] = set()  # their slots: loaded per run from then on (see release_smallest)

    def take(self, slot: tuple, made_for: tuple) -> tuple[Any, Any]:
        """(pipeline, fit) kept for ``slot`` (removed from the pool until the stage hands it back) if it was
        made for ``made_for``, else (None, None); one made for something else is released first, so a slot
        never holds two fits of its components."""
        kept_for, pipe, fit = self._pipes.pop(slot, (None, None, None))
        if pipe is not None and kept_for != made_for:
            pipe = fit = None
            release_freed_memory()  # gone before the new fit measures the memory in use
        return pipe, fit

    def keep(self, slot: tuple, made_for: tuple, pipe, fit) -> None:
        if not self.gave_up and slot not in self._not_kept:
            self._pipes[slot] = (made_for, pipe, fit)

    def holds_any(self) -> bool:
        return bool(self._pipes)

    def note_growth(self, stage: str, grew_by: int, *, loaded: bool) -> None:
        """How much ``stage``'s run grew the memory in use (its measured peak above its start); ``loaded``:
        it loaded a pipeline rather than taking a kept one, so what earlier runs measured no longer applies."""
        self._growth[stage] = grew_by if loaded else max(grew_by, self._growth.get(stage, 0))

    def make_room(self, stage: str, in_use: int, limit: int | None) -> None:
        """Before the kept ``stage`` runs: free the kept compiled models' intermediate buffers unless the stage is
        known to fit beside them: ``in_use`` (bytes held now, kept pipelines included) plus the most the stage grew
        by before stays within ``limit`` (the budget's device bytes; None: unlimited)."""
        grew_by = self._growth.get(stage)
        if stage in self.bounded or (limit is not None and (grew_by is None or in_use + grew_by > limit)):
            self.free_buffers()

    def release_smallest(self, *, spare_largest: bool = False) -> bool:
        """Let the kept pipeline with the fewest weight bytes go, to make room for a stage, and keep the others
        (``spare_largest``: never the one with the most, which a run without a budget keeps whatever it costs: the
        denoiser a Session is for). That slot is not kept again: the stage that needed the room was fitted without
        it and, kept, runs warm (unplanned) from then on. False where there is nothing (else) to let go."""
        sizes = {slot: resident_bytes(pipe, slot[1]) for slot, (_, pipe, _) in self._pipes.items()}
        if len(sizes) <= (1 if spare_largest else 0):
            return False
        smallest = min(sizes, key=sizes.get)
        _, pipe, _ = self._pipes.pop(smallest)
        self._not_kept.add(smallest)
        self.released += 1
        self.let_go += [f"{smallest[3]}:{smallest[4]}{name}" for name in smallest[1]
                        if isinstance(getattr(pipe, name, None), torch.nn.Module)]  # not its tokenizer, scheduler
        del pipe
        release_freed_memory()
        return True

    def free_buffers(self) -> None:
        """Free the kept compiled models' intermediate buffers (they are allocated again on their next call): before
        a stage is planned under a budget, so that its plan sees only the kept weights."""
        for _, pipe, _ in self._pipes.values():
            release_buffers(pipe)
        release_freed_memory()

    def give_up(self, reason: str) -> None:
        """Release every kept pipeline and keep none from now on (the host tiers stay: they take no device
        memory, and the stages' plans count them as free host RAM)."""
        self.gave_up = reason
        self._pipes.clear()
        release_freed_memory()

    def clear(self) -> None:
        self._pipes.clear()
        self.host_tiers.clear()
        release_freed_memory()

    def components(self) -> list[str]:
        """The components kept loaded, as stage:component."""
        return [f"{slot[3]}:{slot[4]}{name}" for slot in self._pipes for name in slot[1]]

    def weights_bytes(self) -> int:
        return sum(resident_bytes(pipe, slot[1]) for slot, (_, pipe, _) in self._pipes.items())


class Session:
    """Generate with one model (a folder, or a single-file checkpoint with its ``config``, ``components``
    replaced by files and ``quantize`` quantized, as memfit.generate's)
    and one set of run options, the stages kept warm between calls.

    One run at a time (a lock): memory is the constraint, so runs never overlap. ``warm=False``
    releases every stage after each run, as memfit.generate does.
    """

    def __init__(self, model: str | Path | None = None, *, dtype: str = "fp32", device: str | torch.device | None = None,
                 budget="auto", backend=None, fallback: str | None = None, warm: bool = True,
                 allow_pickle: bool = False, config: str | Path | None = None,
                 components: dict[str, str | Path] | None = None, quantize: dict[str, str] | None = None,
                 threads: int | None = None):
        self.folder = open_model(model, allow_pickle=allow_pickle, config=config, components=components,
                                 quantize=quantize)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else default_device()
        self.budget = budget
        self.backend = backend
        self.fallback = fallback
        self.threads = check_threads(threads)
        self.pool = WarmPool() if warm else None
        self._lock = threading.Lock()

    def generate(self, prompt: str, *, on_step: Callable[[str, int, int], None] | None = None, **settings) -> Generation:
        """memfit.generate for this session's model and options; ``settings`` are its keyword arguments
        (negative_prompt, steps, guidance, seed, width, height, sampler, ...). ``on_step(stage, done,
        total)`` is called as each stage starts (done = total = 0) and as the denoising loop advances;
        raising Interrupted from it stops the run."""
        with self._lock:
            return generate(prompt, model=self.folder, dtype=self.dtype, device=self.device, budget=self.budget,
                            backend=self.backend, fallback=self.fallback, progress=False, pool=self.pool,
                            on_step=on_step, threads=self.threads, **settings)

    def warm_state(self) -> dict[str, Any]:
        """What is kept loaded, for reports: components, their weight bytes, and why not, where not."""
        if self.pool is None:
            return {"warm": False, "components": [], "weights_bytes": 0, "reason": "warm=False", "released": 0}
        return {"warm": not self.pool.gave_up, "components": self.pool.components(),
                "weights_bytes": self.pool.weights_bytes(), "reason": self.pool.gave_up,
                "released": self.pool.released}

    def close(self) -> None:
        """Release every kept stage."""
        with self._lock:
            if self.pool is not None:
                self.pool.clear()
