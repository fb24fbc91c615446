"""The reference backend: run the module as it is. Every other backend is tested against it."""

from __future__ import annotations

from typing import Any, Callable

from memfit.compile.backends._common import returning_plain_tensors
from memfit.compile.backends.base import Backend, CompileRequest


class EagerBackend(Backend):
    name = "eager"
    float32_tolerance = 0.0

    def compile(self, request: CompileRequest) -> Callable[..., Any]:
        self.resolve_options(request.options)
        return returning_plain_tensors(request.fn)
