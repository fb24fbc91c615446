"""Flat outputs for graph backends, and the layout that rebuilds the module's own output from them.

OpenVINO and ONNX models return a flat list of tensors. A module returns a structure (a diffusers
output class, a tuple with a None in it). The layout (pytree structure + constant leaves) is found
while the module is captured, stored next to the compiled artifact (``outputs.json``), and used on
every call, so a start from the cache needs no eager call to learn the structure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from memfit.errors import MemfitError

# The layout's file in a compiled artifact's folder.
LAYOUT_FILE = "outputs.json"
# Output leaves that are not tensors but can be stored (in outputs.json) and returned as they are.
CONSTANT_TYPES = (type(None), bool, int, float, str)


class OutputLayout:
    """Where a module's outputs go: its pytree structure, which leaves are constants (e.g. None)
    rather than tensors, and which leaves repeat an earlier leaf (``aliases``: leaf -> earlier leaf).

    A repeated tensor is returned once: a diffusers down block returns its last hidden state also
    among its residuals, and a graph converter cannot name one tensor as two outputs (OpenVINO's
    refuses such a model)."""

    def __init__(self, backend: str, spec: Any, constants: dict[int, Any], aliases: dict[int, int] | None = None) -> None:
        self.backend = backend
        self.spec = spec
        self.constants = constants
        self.aliases = aliases or {}

    @property
    def tensor_count(self) -> int:
        return self.spec.num_leaves - len(self.constants) - len(self.aliases)

    def rebuild(self, tensors: list[Any]) -> Any:
        from torch.utils._pytree import tree_unflatten

        remaining = iter(tensors)
        leaves: list[Any] = []
        for i in range(self.spec.num_leaves):
            if i in self.constants:
                leaves.append(self.constants[i])
            elif i in self.aliases:
                leaves.append(leaves[self.aliases[i]])
            else:
                leaves.append(next(remaining))
        return tree_unflatten(leaves, self.spec)

    def to_json(self) -> str:
        from torch.utils._pytree import treespec_dumps

        try:
            spec = treespec_dumps(self.spec)
        except Exception as exc:  # pytree raises several types for an unregistered output class
            raise MemfitError(
                f"Backend {self.backend!r} cannot store this component: its output structure "
                f"({self.spec}) is not serializable ({exc}). Run with MEMFIT_CACHE=0, or return "
                "tuples, dicts or diffusers/transformers output classes."
            ) from exc
        return json.dumps({
            "spec": spec,
            "constants": [[i, v] for i, v in sorted(self.constants.items())],
            "aliases": [[i, j] for i, j in sorted(self.aliases.items())],
        })

    @classmethod
    def from_json(cls, backend: str, text: str) -> "OutputLayout":
        from torch.utils._pytree import treespec_loads

        raw = json.loads(text)
        return cls(
            backend,
            treespec_loads(raw["spec"]),
            {int(i): v for i, v in raw["constants"]},
            {int(i): int(j) for i, j in raw.get("aliases", [])},
        )

    @classmethod
    def load(cls, backend: str, folder: Path) -> "OutputLayout":
        """The layout stored in an artifact's ``folder`` (its LAYOUT_FILE)."""
        return cls.from_json(backend, (folder / LAYOUT_FILE).read_text(encoding="utf-8"))


class FlatOutputs(torch.nn.Module):
    """``fn`` as a module returning a flat tuple of tensors; the structure it flattened goes to
    ``found_layout`` each time it runs (while torch.export traces it, too).

    Not an attribute of the module: torch.export reverts attribute changes of the module it
    traces, so the layout is handed out through a plain callable.
    """

    def __init__(self, backend: str, fn: Callable[..., Any], found_layout: Callable[[OutputLayout], None]) -> None:
        super().__init__()
        self.backend = backend
        self.fn = fn  # a module becomes a submodule, so its weights are parameters of the export
        self.found_layout = found_layout

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, ...]:
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten(self.fn(*inputs))
        constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        odd = sorted({type(v).__name__ for v in constants.values() if not isinstance(v, CONSTANT_TYPES)})
        if odd:
            raise MemfitError(
                f"Backend {self.backend!r} supports outputs made of tensors, None, numbers and strings; "
                f"{name_of(self.fn)} also returns {', '.join(odd)}. Use backend='inductor' or "
                "'eager' for this component."
            )
        first_of: dict[int, int] = {}  # id of a tensor -> the leaf it first appeared at
        aliases = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and first_of.setdefault(id(leaf), i) != i:
                aliases[i] = first_of[id(leaf)]
        self.found_layout(OutputLayout(self.backend, spec, constants, aliases))
        return tuple(leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and i not in aliases)


def name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
