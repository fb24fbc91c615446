"""OpenVINO through its torch.compile backend (``openvino.torch``).

Three things learned the hard way (openvino 2026.4, torch 2.13, CPU), each handled here:

* ``import openvino.torch`` sets ``torch._dynamo.config.inline_inbuilt_nn_modules = False`` for the
  whole process. We import and compile inside ``preserved_torch_settings()`` (so the user's
  process keeps its setting) and apply the value OpenVINO expects only around our own calls.
* With default options its backend fails on conv models (IndexError in symbolic_shapes
  ``issue_guard``); ``aot_autograd=True`` works, so it is our default.
* Its CPU plugin defaults to bf16 inference on CPUs that support it; we pin
  ``INFERENCE_PRECISION_HINT`` to the dtype the model runs in, so fp32 stays fp32.

OpenVINO's own "model_caching" option is refused: it is what swapped weights for fake tensors
and broke the second generation (failure 5 of DESIGN.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Callable, Iterator, Mapping, Sequence

from memfit.backends._common import returning_plain_tensors, run_dtype, warm_up
from memfit.backends.base import Availability, Backend
from memfit.backends.torch_settings import preserved_torch_settings
from memfit.errors import MemfitError

_PRECISION_HINTS = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}


class OpenVINOBackend(Backend):
    name = "openvino"
    float32_tolerance = 1e-4
    default_options: Mapping[str, Any] = {
        "device": "CPU",  # OpenVINO device: "CPU", "GPU" (Intel iGPU/dGPU), "NPU", "AUTO"
        "aot_autograd": True,
        "config": {},  # OpenVINO properties; INFERENCE_PRECISION_HINT defaults to the run dtype
    }

    def available(self) -> Availability:
        if importlib.util.find_spec("openvino") is None:
            return Availability(False, "openvino is not installed: pip install memfit[openvino]")
        return Availability(True, f"openvino {self.version()} is available")

    def version(self) -> str:
        from importlib import metadata

        try:
            return metadata.version("openvino")
        except metadata.PackageNotFoundError:
            return "absent"

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
        if "model_caching" in opts["config"]:
            raise MemfitError(
                "OpenVINO's model_caching is not supported by memfit: it replaces weights with "
                "fake tensors and breaks the second run. Remove it; memfit caches artifacts itself."
            )
        dtype = run_dtype(example_inputs)
        ov_config = {"INFERENCE_PRECISION_HINT": _PRECISION_HINTS.get(str(dtype), "f32"), **opts["config"]}
        backend_options = {"device": opts["device"], "aot_autograd": opts["aot_autograd"], "config": ov_config}

        with preserved_torch_settings():
            try:
                import openvino.torch  # noqa: F401  (registers the "openvino" dynamo backend)
            except ImportError as exc:
                raise MemfitError(
                    f"Backend 'openvino' could not import openvino.torch ({exc}); reinstall with "
                    "pip install memfit[openvino], or use backend='eager'."
                ) from exc
            compiled = torch.compile(fn, backend="openvino", options=backend_options)
            run = returning_plain_tensors(compiled, settings=_openvino_call_settings)
            warm_up(run, example_inputs)
        return run


@contextlib.contextmanager
def _openvino_call_settings() -> Iterator[None]:
    """What openvino.torch would set for the whole process, applied only while our graph runs."""
    import torch

    with preserved_torch_settings(), torch._dynamo.config.patch(inline_inbuilt_nn_modules=False):
        yield
