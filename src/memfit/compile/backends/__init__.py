"""Execution backends: eager, inductor (torch.compile), openvino, onnxruntime, and out-of-tree ones.

    from memfit.compile.backends import CompileRequest, get_backend
    run = get_backend("inductor").compile(CompileRequest(module, example_inputs))
    output = run(*inputs)   # plain torch.Tensor outputs, torch's global settings untouched
"""

from memfit.compile.backends.base import Availability, Backend, CompileRequest
from memfit.compile.backends.outputs import plain_outputs
from memfit.compile.backends.registry import (
    ENTRY_POINT_GROUP,
    available_backends,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
)
from memfit.compile.backends.torch_settings import preserved_torch_settings, snapshot_torch_settings

__all__ = [
    "ENTRY_POINT_GROUP",
    "Availability",
    "Backend",
    "CompileRequest",
    "available_backends",
    "get_backend",
    "list_backends",
    "plain_outputs",
    "preserved_torch_settings",
    "register_backend",
    "snapshot_torch_settings",
    "unregister_backend",
]
