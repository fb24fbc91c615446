"""Snapshot and restore torch's process-wide settings, so no backend leaves them changed.

Why: importing ``openvino.torch`` sets ``torch._dynamo.config.inline_inbuilt_nn_modules = False``
for the whole process, which silently changes how every later ``torch.compile`` in the user's
program traces. A backend does its imports and compiles inside ``preserved_torch_settings()``
and applies the settings it needs only around its own calls (``torch._dynamo.config.patch``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


def _config_modules() -> dict[str, Any]:
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    return {
        "dynamo": torch._dynamo.config,
        "inductor": torch._inductor.config,
        "functorch": torch._functorch.config,
    }


def snapshot_torch_settings() -> dict[str, Any]:
    """A comparable picture of the global settings a backend could change."""
    import torch

    snapshot: dict[str, Any] = {
        name: module.get_config_copy() for name, module in _config_modules().items()
    }
    snapshot.update(
        default_dtype=torch.get_default_dtype(),
        num_threads=torch.get_num_threads(),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        grad_enabled=torch.is_grad_enabled(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return snapshot


def restore_torch_settings(snapshot: dict[str, Any]) -> None:
    import torch

    for name, module in _config_modules().items():
        current = module.get_config_copy()
        changed = {k: v for k, v in snapshot[name].items() if current.get(k) is not v and current.get(k) != v}
        for key, value in changed.items():
            setattr(module, key, value)
    torch.set_default_dtype(snapshot["default_dtype"])
    if torch.get_num_threads() != snapshot["num_threads"]:
        torch.set_num_threads(snapshot["num_threads"])
    torch.set_float32_matmul_precision(snapshot["float32_matmul_precision"])
    torch.set_grad_enabled(snapshot["grad_enabled"])
    if torch.are_deterministic_algorithms_enabled() != snapshot["deterministic"]:
        torch.use_deterministic_algorithms(snapshot["deterministic"])


@contextlib.contextmanager
def preserved_torch_settings() -> Iterator[None]:
    """Run the block, then put every global torch setting back as it was (even on error)."""
    snapshot = snapshot_torch_settings()
    try:
        yield
    finally:
        restore_torch_settings(snapshot)
