"""ONNX Runtime: export the module once with ``torch.onnx.export`` and run the ONNX graph.

The exported ``model.onnx`` (plus its external weights file) is an ordinary file artifact, so it is
what memfit's content-addressed cache stores, with ``outputs.json`` (the layout that rebuilds the
module's output structure from ONNX's flat outputs: memfit.compile.backends.output_layout): given
``cache=`` and a ``weights_fingerprint``, the export is keyed by weights, graph, input signature,
options and library versions, and a second start (or a second pipeline sharing the component) loads
it without exporting and without an eager call.

Shapes are static: the graph is exported for the example inputs' shapes and dtypes, and calling it
with others is an error that says so (compile again for those shapes).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from memfit.compile.backends._common import graph_id, tensor_signature
from memfit.compile.backends.base import Availability, Backend, CompileRequest
from memfit.compile.backends.output_layout import LAYOUT_FILE, FlatOutputs, OutputLayout, name_of
from memfit.compile.backends.outputs import plain_outputs
from memfit.compile.backends.torch_settings import preserved_torch_settings
from memfit.errors import MemfitError

MODEL_FILE = "model.onnx"
_REQUIRED_MODULES = ("onnxruntime", "onnx", "onnxscript")
# Part of the key; bump it when what an entry holds changes, so older entries miss, not misread.
_ENTRY_FORMAT = "onnxruntime-export/2"


class ONNXRuntimeBackend(Backend):
    name = "onnxruntime"
    holds_own_weights = True  # the session reads the ONNX file's weights into memory of its own
    float32_tolerance = 1e-4
    default_options: Mapping[str, Any] = {
        "providers": ("CPUExecutionProvider",),  # ORT execution providers, in preference order
        "opset": None,  # ONNX opset for export; None lets torch choose
        "intra_op_threads": 0,  # 0 = ORT's default (all cores)
    }

    def available(self) -> Availability:
        missing = [m for m in _REQUIRED_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            return Availability(
                False,
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                "pip install memfit[onnxruntime]",
            )
        return Availability(True, f"onnxruntime {self.version()} is available")

    def version(self) -> str:
        from importlib import metadata

        try:
            return metadata.version("onnxruntime")
        except metadata.PackageNotFoundError:
            return "absent"

    def compile(self, request: CompileRequest) -> Callable[..., Any]:
        opts = self.resolve_options(request.options)
        self.require_available()
        signature = _input_signature(request.example_inputs)

        def build(out_dir: Path) -> dict[str, Any]:
            request.notify_build()
            return _export(request.fn, request.example_inputs, out_dir, opts["opset"])

        def load(model_dir: Path) -> Callable[..., Any]:
            request.notify_load()  # the torch weights go before the session reads its own copy
            return _load(model_dir, signature, opts)

        if request.cache is not None and request.weights_fingerprint:
            from memfit.cache import compile_key

            key = compile_key(
                weights_fingerprint=request.weights_fingerprint,
                graph=graph_id(request.fn),
                input_signature=signature,
                backend=self.name,
                # providers act at load, not in the file
                backend_options={"opset": opts["opset"], "entry_format": _ENTRY_FORMAT},
                backend_distributions=_REQUIRED_MODULES,
            )
            return load(request.cache.get_or_build(key, build))
        with tempfile.TemporaryDirectory(prefix="memfit-onnx-") as tmp:
            build(Path(tmp))
            # The session reads the whole model (external weights included) at creation, so the
            # files are not needed afterwards.
            return load(Path(tmp))


def _input_signature(example_inputs: Sequence[Any]) -> list[list[Any]]:
    if any(isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 for v in example_inputs):
        raise MemfitError(
            "Backend 'onnxruntime' cannot feed bfloat16 inputs (numpy has no bfloat16); "
            "run this component in float32 or float16."
        )
    return tensor_signature("onnxruntime", example_inputs)


def _export(fn: Callable[..., Any], example_inputs: Sequence[Any], out_dir: Path, opset: int | None) -> dict[str, Any]:
    layouts: list[OutputLayout] = []
    module = FlatOutputs("onnxruntime", fn, layouts.append)
    with preserved_torch_settings(), torch.no_grad():
        try:
            torch.onnx.export(
                module,
                tuple(example_inputs),
                str(out_dir / MODEL_FILE),
                dynamo=True,
                external_data=True,
                opset_version=opset,
                verbose=False,
            )
        except MemfitError:
            raise
        except Exception as exc:
            raise MemfitError(
                f"Exporting {name_of(fn)} to ONNX failed ({type(exc).__name__}: {exc}). "
                "Use another backend for this component (e.g. backend='inductor' or 'eager')."
            ) from exc
    (out_dir / LAYOUT_FILE).write_text(layouts[-1].to_json(), encoding="utf-8")
    return {"outputs": layouts[-1].tensor_count}


def _load(model_dir: Path, signature: list[list[Any]], opts: Mapping[str, Any]) -> Callable[..., Any]:
    import onnxruntime as ort

    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = int(opts["intra_op_threads"])
    session = ort.InferenceSession(
        str(model_dir / MODEL_FILE), sess_options=session_options, providers=list(opts["providers"])
    )
    layout = OutputLayout.load("onnxruntime", model_dir)
    input_names = [i.name for i in session.get_inputs()]
    if len(input_names) != len(signature) or len(session.get_outputs()) != layout.tensor_count:
        raise MemfitError(
            f"The ONNX model in {model_dir} has {len(input_names)} inputs and {len(session.get_outputs())} "
            f"outputs, but the example had {len(signature)} and {layout.tensor_count}; clear it with "
            "`memfit cache clear --kind compiled` and retry."
        )

    def run(*args: Any) -> Any:
        actual = [[list(a.shape), str(a.dtype)] if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        if actual != signature:
            raise MemfitError(
                f"Backend 'onnxruntime' compiled this component for inputs {signature} but got "
                f"{actual}; shapes are static, so compile again with example inputs of the new shape."
            )
        feeds = {name: a.detach().cpu().contiguous().numpy() for name, a in zip(input_names, args)}
        return plain_outputs(layout.rebuild([torch.from_numpy(o) for o in session.run(None, feeds)]))

    run.session = session  # type: ignore[attr-defined]  (for inspection and tests)
    return run
