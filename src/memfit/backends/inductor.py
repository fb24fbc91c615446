"""torch.compile with TorchInductor: fused kernels generated for this machine's CPU or GPU.

Compiled code is cached by inductor's own on-disk caches (FX graph / AOTAutograd caches); memfit's
store does not hold it yet. Inductor options are applied per compile (``torch.compile(options=)``),
never by setting ``torch._inductor.config`` globally.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, Callable, Mapping, Sequence

from memfit.backends._common import returning_plain_tensors, warm_up
from memfit.backends.base import Availability, Backend
from memfit.backends.torch_settings import preserved_torch_settings


class InductorBackend(Backend):
    name = "inductor"
    float32_tolerance = 1e-4
    default_options: Mapping[str, Any] = {
        "mode": None,  # torch.compile mode: None, "reduce-overhead", "max-autotune", ...
        "dynamic": False,  # shapes are fixed per generation; False avoids symbolic-shape guards
        "fullgraph": False,
        "inductor_config": {},  # per-compile torch._inductor.config overrides
    }

    def available(self) -> Availability:
        # On CPU inductor compiles C++; without a compiler the first call fails deep in codegen.
        if sys.platform != "win32" and not (shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")):
            return Availability(
                False,
                "inductor needs a C++ compiler on CPU and none was found: install g++ or clang "
                "(e.g. apt-get install g++), or use backend='eager'.",
            )
        return Availability(True, "inductor is available")

    def compile(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[Any],
        options: Mapping[str, Any] | None = None,
        cache: Any = None,
        weights_fingerprint: str | None = None,
    ) -> Callable[..., Any]:
        import torch

        opts = self.resolve_options(options)
        self.require_available()
        with preserved_torch_settings():
            # torch.compile refuses mode and options together; pass whichever was asked for.
            tuning = {"options": dict(opts["inductor_config"])} if opts["inductor_config"] else {"mode": opts["mode"]}
            compiled = torch.compile(
                fn, backend="inductor", dynamic=opts["dynamic"], fullgraph=opts["fullgraph"], **tuning
            )
            run = returning_plain_tensors(compiled, settings=preserved_torch_settings)
            warm_up(run, example_inputs)
        return run
