"""The reference backend: run the module as it is. Every other backend is tested against it."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from memfit.compile.backends._common import returning_plain_tensors
from memfit.compile.backends.base import Backend


class EagerBackend(Backend):
    name = "eager"
    float32_tolerance = 0.0

    def compile(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[Any],
        options: Mapping[str, Any] | None = None,
        cache: Any = None,
        weights_fingerprint: str | None = None,
    ) -> Callable[..., Any]:
        self.resolve_options(options)
        return returning_plain_tensors(fn)
