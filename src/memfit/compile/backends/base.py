"""What a backend is: a named way to turn a module (or function) into a callable that runs faster.

A backend's contract, tested for every backend in tests/test_backends.py:

* ``compile(request)``, given a ``CompileRequest`` (the function, its example inputs, and how to
  compile it), returns a callable with the function's positional signature whose outputs are PLAIN
  ``torch.Tensor`` objects (never subclasses or fake tensors), equal to eager within the backend's
  stated tolerance, on every call, not just the first.
* Compiling or running never leaves torch's global settings changed (see ``torch_settings``).
* ``available()`` says, without side effects, whether the backend can run here and, if not,
  what to install.
* Compile errors surface in ``compile()`` (it runs the example inputs once), not in the middle
  of a generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from memfit.errors import MemfitError


class Availability(NamedTuple):
    """``ok, reason = backend.available()``; ``reason`` says what to do when ``ok`` is False."""

    ok: bool
    reason: str


# eq=False: requests compare by identity; comparing them field by field would compare tensors.
@dataclass(frozen=True, eq=False)
class CompileRequest:
    """What ``Backend.compile`` compiles, and how: ``backend.compile(CompileRequest(module, example_inputs))``.

    fn:                  the module or function to compile.
    example_inputs:      the positional inputs it is compiled for; compile() runs it on them once.
    options:             the backend's options (``Backend.default_options`` names them); None: the defaults.
    cache:               a memfit CacheStore to key, load and save the compiled artifact through; None: none.
    weights_fingerprint: what identifies ``fn``'s weights in the store's key; without one nothing is stored.

    For a backend that ``holds_own_weights`` (its compiled artifact carries its own copy of the weights,
    so the torch module's go unused), two hooks let the caller keep those torch weights out of memory
    (memfit.compile.weights); other backends never call them:

    on_build:            called when no stored artifact was found and one is built (the expensive path,
                         which reads the torch weights), before building starts.
    before_load:         called once the artifact is built or found, before it is loaded, so the caller
                         can let the torch weights go before the artifact's own copy comes in.
    module:              the module whose method ``fn`` calls, where there is one: a backend that captures
                         ``fn`` can prepare its layers for the capture (OpenVINO's compressed weights).
    """

    fn: Callable[..., Any]
    example_inputs: Sequence[Any]
    options: Mapping[str, Any] | None = None
    cache: Any = None
    weights_fingerprint: str | None = None
    on_build: Callable[[], None] | None = None
    before_load: Callable[[], None] | None = None
    module: Any = None

    def notify_build(self) -> None:
        """A backend that holds its own weights calls this when it starts building its artifact."""
        if self.on_build is not None:
            self.on_build()

    def notify_load(self) -> None:
        """A backend that holds its own weights calls this just before it loads its artifact."""
        if self.before_load is not None:
            self.before_load()


class Backend:
    """Base class of every backend; subclasses set ``name`` and implement ``compile``."""

    name: str = ""
    # Maximum absolute difference from eager the tests accept for float32 on the tiny model.
    float32_tolerance: float = 1e-5
    # Every option a backend understands, with its default; unknown options are an error.
    default_options: Mapping[str, Any] = {}
    # True when the compiled artifact carries its own copy of the weights (the torch module's are then
    # unused): compile() calls the request's on_build and before_load hooks (see CompileRequest), through
    # which memfit.compile.weights keeps the torch weights out of memory.
    holds_own_weights: bool = False
    # True when the backend computes in a precision of its own, set by ``configured(precision)``
    # (memfit.compile.precision); otherwise it computes in the weights' dtype.
    has_own_precision: bool = False
    # For a backend that holds its own weights: the stored formats (memfit.quant, StoredFormat.name) of the
    # quantized layers it compiles from, keeping them compressed; a component stored in others is refused.
    stored_formats: frozenset[str] = frozenset()
    precision: str | None = None  # None: the dtype the component runs in

    def available(self) -> Availability:
        return Availability(True, f"{self.name} is available")

    def version(self) -> str:
        """The version of the library doing the work, for cache keys."""
        import torch

        return torch.__version__

    def compile(self, request: CompileRequest) -> Callable[..., Any]:
        """``request.fn`` compiled for ``request.example_inputs``; see the module doc for the contract."""
        raise NotImplementedError

    def resolve_options(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults overlaid with ``options``; an unknown option names the valid ones."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.default_options))
        if unknown:
            valid = ", ".join(sorted(self.default_options)) or "none"
            raise MemfitError(
                f"Unknown option(s) {', '.join(unknown)} for backend {self.name!r}; "
                f"valid options: {valid}."
            )
        return {**self.default_options, **options}

    def configured(self, precision: str | None) -> "Backend":
        """A copy of this backend computing in ``precision`` ("fp32", "bf16", "fp16")."""
        import copy

        if not self.has_own_precision:
            raise MemfitError(f"Backend {self.name!r} computes in the weights' dtype; it has no precision to set.")
        configured = copy.copy(self)
        configured.precision = precision
        return configured

    def held_precision(self, dtype: str) -> str:
        """The precision ("fp32", "bf16", "fp16") the compiled model holds its weights in, for a component that
        runs in ``dtype`` (same names): what a budget counts for it."""
        return self.precision or dtype

    @property
    def label(self) -> str:
        """The name, with the precision where one is set: what a cached result computed with it depends on."""
        return self.name if self.precision is None else f"{self.name}@{self.precision}"

    def require_available(self) -> None:
        ok, reason = self.available()
        if not ok:
            raise MemfitError(f"Backend {self.name!r} cannot run here: {reason}")

    def __repr__(self) -> str:
        return f"<memfit backend {self.label!r}>"
