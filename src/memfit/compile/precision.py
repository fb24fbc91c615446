"""The compute precision of a backend, stated apart from the weights' dtype.

``--dtype`` is what the weights are loaded as; ``--precision`` is what a backend computes in. Only a
backend with a precision of its own (``Backend.has_own_precision``: OpenVINO, whose
INFERENCE_PRECISION_HINT it sets) can differ from the dtype: fp32 weights computed in bf16 run the
bf16 kernels while the weights file stays fp32. Eager PyTorch (and inductor, and ONNX Runtime)
compute in the weights' dtype, so for them a precision other than the dtype is refused rather than
silently ignored. Left out, the precision is the dtype, as before this option existed.
"""

from __future__ import annotations

from typing import Any, Mapping

from memfit.compile.backends import get_backend
from memfit.dtypes import dtype_name as name_of
from memfit.errors import MemfitError

__all__ = ["PRECISIONS", "check_precision", "describe_precision", "with_precision"]

PRECISIONS = ("fp32", "bf16", "fp16")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise MemfitError(f"--precision {precision!r} is not a compute precision memfit knows; use one of "
                          f"{', '.join(PRECISIONS)} (or leave it out: the --dtype).")
    return precision


def describe_precision(precision: str, dtype: str) -> str:
    """One line on what computing in ``precision`` with ``dtype`` weights changes (for memfit plan)."""
    check_precision(precision)
    if precision == dtype:
        return f"precision {precision}: the weights' dtype; nothing changes."
    bits = {"fp32": 24, "bf16": 8, "fp16": 11}
    return (f"precision {precision} with {dtype} weights (--backend openvino only; refused for eager PyTorch): every op "
            f"rounds its result to {bits[precision]} mantissa bits instead of {bits[dtype]}, and each compiled model holds "
            f"{'half' if bits[precision] < bits[dtype] else 'twice'} the bytes of its weights; measured on the tiny SD model "
            "(64x64, 2 steps), bf16 against fp32 changes pixels by at most 6/255 (mean 0.87/255).")


def with_precision(backend: Any, precision: str | None, dtype: Any) -> Any:
    """``backend`` (a compile spec as compile_components takes it, or None) computing in ``precision``.

    Each backend with a precision of its own becomes an instance configured with it; any other backend,
    and no backend (eager PyTorch), must compute in ``dtype`` ("fp32", or a torch dtype), else a
    MemfitError says which component and what to give instead.
    """
    if precision is None:
        return backend
    check_precision(precision)
    dtype_name = name_of(dtype)
    if backend is None:
        _refuse_unless_equal("eager", "", precision, dtype_name)
        return None
    if isinstance(backend, Mapping):
        return {name: _configured(spec, precision, dtype_name, name) for name, spec in backend.items()}
    return _configured(backend, precision, dtype_name, "")


def _configured(spec: Any, precision: str, dtype_name: str, component: str) -> Any:
    if spec is None:
        return None
    be = get_backend(spec)
    if be.has_own_precision:
        return be.configured(precision)
    _refuse_unless_equal(be.name, component, precision, dtype_name)
    return spec


def _refuse_unless_equal(backend: str, component: str, precision: str, dtype_name: str) -> None:
    if precision == dtype_name:
        return
    which = f" (for {component})" if component and component != "*" else ""
    raise MemfitError(
        f"--precision {precision} differs from --dtype {dtype_name}, but the {backend} backend{which} computes in the "
        f"weights' dtype: give --dtype {precision}, or --backend openvino (whose compute precision is its own), or leave "
        "--precision out."
    )
