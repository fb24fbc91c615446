"""A linear layer whose weight stays in its stored bytes and is dequantized in each forward.

The weight is dequantized into a temporary tensor in the input's dtype just before the matmul and
dropped after it: one layer's weight at a time in the compute dtype, whatever the model's size
(the "dequantization scratch" the planner adds to a stage). The arithmetic is diffusers' GGUFLinear's
native path (dequantize, cast to the compute dtype, F.linear), so outputs match its GGUF loading bit
for bit; an fp8 weight converts exactly, as upcasting it when loading would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memfit.quant.formats import INT8_FORMAT, STORAGE_DTYPE, StoredTensor, mark_stored

__all__ = ["INT8_MATMUL", "QuantizedLinear", "logical_weights", "use_stored_linears"]

#: Whether an int8 layer on the CPU multiplies its stored weight directly (torch's _weight_int8pack_mm) rather
#: than dequantizing it first. Off: docs/int8_matmul.md has the measurements that decided it.
INT8_MATMUL = False


def _int8_matmul_runs(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's CPU int8 weight-only matmul takes these operands (activations in a float dtype on the CPU;
    the op is missing from older torch)."""
    return (inputs.device.type == "cpu" and weight.device.type == "cpu"
            and inputs.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


class QuantizedLinear(torch.nn.Linear):
    """``nn.Linear(in_features, out_features)`` with its weight ``stored``: its format's bytes (STORAGE_DTYPE), and
    the scale they are multiplied by, if any. A Linear to the code that looks for one: a LoRA wraps it as it
    wraps any linear layer (unfused, over the stored weight, as ComfyUI-GGUF applies LoRAs)."""

    #: While torch.export captures the layer for OpenVINO: its weight as a function of the compute dtype, in tensors
    #: made beforehand (openvino_pattern), instead of the byte arithmetic (memfit.compile.backends.openvino_compressed).
    export_weight = None

    def openvino_pattern(self):
        """The weight as OpenVINO's decompression pattern (memfit.quant.openvino_pattern), or None for a format
        OpenVINO does not keep compressed."""
        from memfit.quant.openvino_pattern import decompression_pattern

        return decompression_pattern(self)

    def __init__(self, in_features: int, out_features: int, stored: StoredTensor, *, bias: bool,
                 bias_dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"):
        torch.nn.Module.__init__(self)  # not Linear's: its weight would be made (and initialised) in floats
        self.in_features, self.out_features, self.stored = in_features, out_features, stored
        self.format = stored.format
        shape = self.format.stored_shape((out_features, in_features))
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=STORAGE_DTYPE, device=device), requires_grad=False)
        mark_stored(self.weight, self.format)
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                       requires_grad=False) if bias else None
        # The weight dequantized once, kept while a budget has room for it (memfit.run.executor
        # keep_dequantized): a forward then runs as fast as with unquantized weights.
        self.dequantized: torch.Tensor | None = None
        self._scale_on_device: torch.Tensor | None = None

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        mark_stored(self.weight, self.format)  # loading with assign=True puts a new Parameter in its place

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        kept = self.dequantized
        bias = self.bias.to(inputs.dtype) if self.bias is not None else None
        if self.export_weight is not None and torch.compiler.is_exporting():
            return F.linear(inputs, self.export_weight(inputs.dtype), bias)
        if kept is not None and kept.dtype == inputs.dtype and kept.device == self.weight.device:
            weight = kept
        else:
            stored = self._stored_here()
            if INT8_MATMUL and stored.format is INT8_FORMAT and _int8_matmul_runs(inputs, self.weight):
                flat = inputs.reshape(-1, self.in_features).contiguous()
                out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, stored.scale.to(inputs.dtype))
                out = out.reshape(*inputs.shape[:-1], self.out_features)
                return out + bias if bias is not None else out
            weight = stored.dequantize(self.weight, inputs.dtype)
        return F.linear(inputs, weight, bias)

    def _stored_here(self) -> StoredTensor:
        """``stored`` with a per-row scale (int8's) on the weight's device: copied there once per device, not at
        every forward (a copy from the file's mapping would make the host wait for the device)."""
        scale = self.stored.scale
        if scale is None or scale.ndim == 0 or scale.device == self.weight.device:
            return self.stored
        moved = self._scale_on_device
        if moved is None or moved.device != self.weight.device:
            moved = self._scale_on_device = scale.to(self.weight.device)
        return self.stored._replace(scale=moved)

    def extra_repr(self) -> str:
        scaled = ", scaled" if self.stored.scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, stored as {self.format.name}{scaled}"


def use_stored_linears(module: torch.nn.Module, stored: dict[str, StoredTensor]
                       ) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Replace each ``nn.Linear`` of ``module`` whose weight ``stored`` names (live weight name -> StoredTensor)
    by a QuantizedLinear of that format. Returns (the stored weights of other modules, which
    the caller dequantizes when loading; (name, logical shape, the module's shape) for each Linear of another
    shape than its stored weight)."""
    others, mismatched = [], []
    for name, tensor in stored.items():
        shape = tensor.shape
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        if leaf != "weight" or type(owner) is not torch.nn.Linear:
            others.append(name)
            continue
        needed = (owner.out_features, owner.in_features)
        if tuple(shape) != needed:
            mismatched.append((name, tuple(shape), needed))
            continue
        bias = owner.bias
        replacement = QuantizedLinear(owner.in_features, owner.out_features, tensor, bias=bias is not None,
                                      bias_dtype=bias.dtype if bias is not None else torch.float32,
                                      device=owner.weight.device)
        parent_path, _, child = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, child, replacement)
    return others, mismatched


@contextlib.contextmanager
def logical_weights(modules) -> Iterator[None]:
    """Within the block, every QuantizedLinear of ``modules`` shows a weight of its logical shape (no memory: one
    zero, expanded) in its bias's dtype, for code that reads a layer's weight to size or place what it adds to it:
    a LoRA loader sizes its matrices from ``weight.shape`` and puts them on ``weight``'s device and dtype."""
    swapped = []
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, QuantizedLinear):
                dtype = layer.bias.dtype if layer.bias is not None else torch.float32
                swapped.append((layer.weight, layer.weight.data))
                layer.weight.data = torch.zeros((), dtype=dtype, device=layer.weight.device).expand(
                    layer.out_features, layer.in_features)
    try:
        yield
    finally:
        for weight, data in swapped:
            weight.data = data
