"""Linear and convolution layers whose weight stays in its stored bytes and is dequantized in each forward.

The weight is dequantized into a temporary tensor in the input's dtype just before the matmul (or the
convolution) and dropped after it: one layer's weight at a time in the compute dtype, whatever the model's
size (the "dequantization scratch" the planner adds to a stage). The arithmetic is diffusers' GGUFLinear's
native path (dequantize, cast to the compute dtype, F.linear), so outputs match its GGUF loading bit
for bit; an fp8 weight converts exactly, as upcasting it when loading would.

A convolution's weight is stored as its file holds it: flattened to [out, in/groups * kh * kw] (what
``--quantize`` writes: a block format's blocks run along a row, and a kernel's width, 3, is no whole
block), or in its 4-D shape where its format's block is one value (fp8, int8). Either dequantizes to
the same values, reshaped to the kernel's shape.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memfit.quant.formats import INT8_FORMAT, STORAGE_DTYPE, StoredTensor, mark_stored

__all__ = ["INT8_MATMUL", "QuantizedConv2d", "QuantizedLinear", "StoredWeightLayer", "layer_weight", "logical_weights",
           "use_stored_layers"]

#: Whether an int8 layer on the CPU multiplies its stored weight directly (torch's _weight_int8pack_mm) rather
#: than dequantizing it first. Off: docs/int8_matmul.md has the measurements that decided it.
INT8_MATMUL = False


def _int8_matmul_runs(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's CPU int8 weight-only matmul takes these operands (activations in a float dtype on the CPU;
    the op is missing from older torch)."""
    return (inputs.device.type == "cpu" and weight.device.type == "cpu"
            and inputs.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


class StoredWeightLayer:
    """What a layer whose weight is ``stored`` (its format's bytes, STORAGE_DTYPE, and the scale they are multiplied
    by, if any) does with it, whatever the layer: it holds the bytes as ``weight``, dequantizes them at each
    forward into the shape it runs with (``logical_shape``), or uses the copy kept in ``dequantized``."""

    stored: StoredTensor
    logical_shape: tuple[int, ...]  # the weight's shape as the layer runs it

    #: While torch.export captures the layer for OpenVINO: its weight as a function of the compute dtype, in tensors
    #: made beforehand (openvino_pattern), instead of the byte arithmetic (memfit.compile.backends.openvino_compressed).
    export_weight = None

    def openvino_pattern(self):
        """The weight as OpenVINO's decompression pattern (memfit.quant.openvino_pattern), or None for a format
        OpenVINO does not keep compressed."""
        from memfit.quant.openvino_pattern import decompression_pattern

        return decompression_pattern(self)

    def _hold_stored(self, stored: StoredTensor, device) -> None:
        self.stored, self.format = stored, stored.format
        self.weight = torch.nn.Parameter(torch.empty(self.format.stored_shape(stored.shape), dtype=STORAGE_DTYPE,
                                                     device=device), requires_grad=False)
        mark_stored(self.weight, self.format)
        # The weight dequantized once, kept while a budget has room for it (memfit.run.executor
        # keep_dequantized): a forward then runs as fast as with unquantized weights.
        self.dequantized: torch.Tensor | None = None
        self._scale_on_device: torch.Tensor | None = None

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        mark_stored(self.weight, self.format)  # loading with assign=True puts a new Parameter in its place

    def dequantized_bytes(self, dtype: torch.dtype) -> int:
        """What the weight takes dequantized in ``dtype``."""
        return math.prod(self.logical_shape) * dtype.itemsize

    def dequantize_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values in ``dtype``, in the shape the layer runs with."""
        return self._stored_here().dequantize(self.weight, dtype).reshape(self.logical_shape)

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight to run inputs of ``dtype`` with: the kept copy where it is in that dtype and on the weight's
        device, else dequantized now (while OpenVINO's export captures the layer: its pattern)."""
        if self.export_weight is not None and torch.compiler.is_exporting():
            return self.export_weight(dtype)
        kept = self.dequantized
        if kept is not None and kept.dtype == dtype and kept.device == self.weight.device:
            return kept
        return self.dequantize_weight(dtype)

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

    def _stored_repr(self) -> str:
        scaled = ", scaled" if self.stored.scale is not None else ""
        return f"stored as {self.format.name}{scaled}"


class QuantizedLinear(StoredWeightLayer, torch.nn.Linear):
    """``nn.Linear(in_features, out_features)`` with its weight ``stored``. A Linear to the code that looks for one:
    a LoRA wraps it as it wraps any linear layer (unfused, over the stored weight, as ComfyUI-GGUF applies
    LoRAs)."""

    def __init__(self, in_features: int, out_features: int, stored: StoredTensor, *, bias: bool,
                 bias_dtype: torch.dtype = torch.float32, device: str | torch.device = "meta"):
        torch.nn.Module.__init__(self)  # not Linear's: its weight would be made (and initialised) in floats
        self.in_features, self.out_features = in_features, out_features
        self.logical_shape = (out_features, in_features)
        self._hold_stored(stored, device)
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                       requires_grad=False) if bias else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(inputs.dtype) if self.bias is not None else None
        kept = self.dequantized
        if (INT8_MATMUL and self.format is INT8_FORMAT and _int8_matmul_runs(inputs, self.weight)
                and (kept is None or kept.dtype != inputs.dtype or kept.device != self.weight.device)):
            flat = inputs.reshape(-1, self.in_features).contiguous()
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self._stored_here().scale.to(inputs.dtype))
            out = out.reshape(*inputs.shape[:-1], self.out_features)
            return out + bias if bias is not None else out
        return F.linear(inputs, self.weight_in(inputs.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._stored_repr()}"


class QuantizedConv2d(StoredWeightLayer, torch.nn.Conv2d):
    """``conv`` (an ``nn.Conv2d``: its channels, kernel, stride, padding, dilation, groups, padding mode) with its
    weight ``stored``, flattened or in its 4-D shape. A Conv2d to the code that looks for one (a LoRA wraps
    it as any convolution).

    Made with Conv2d's own arguments instead, it is a plain ``nn.Conv2d``: peft makes a LoRA's A and B
    convolutions as the type of the layer it wraps."""

    def __new__(cls, *args, stored: StoredTensor | None = None, **kwargs):
        if stored is None and (args or kwargs):  # no arguments at all: a copy (copy.deepcopy) being made
            return torch.nn.Conv2d(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, conv: torch.nn.Conv2d, *, stored: StoredTensor):
        bias = conv.bias
        # Conv2d's own settings; its weight and bias made on the meta device (no memory), then replaced.
        torch.nn.Conv2d.__init__(self, conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                                 padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                                 bias=bias is not None, padding_mode=conv.padding_mode, device="meta")
        device = conv.weight.device
        self.logical_shape = (conv.out_channels, conv.in_channels // conv.groups, *conv.kernel_size)
        del self.weight
        self._hold_stored(stored, device)
        if bias is not None:
            self.bias = torch.nn.Parameter(torch.empty(conv.out_channels, dtype=bias.dtype, device=device),
                                           requires_grad=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(inputs.dtype) if self.bias is not None else None
        return self._conv_forward(inputs, self.weight_in(inputs.dtype), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._stored_repr()}"


def layer_weight(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``layer``'s forward runs inputs of ``dtype`` with, for code that calls F.conv2d or F.linear with a
    layer's weight itself (memfit.run.banded_decode): a quantized layer's dequantized, any other's as it is."""
    return layer.weight_in(dtype) if isinstance(layer, StoredWeightLayer) else layer.weight


def _conv_shapes(conv: torch.nn.Conv2d) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes a convolution's stored weight may have: flattened, and its own."""
    shape = tuple(conv.weight.shape)
    return (shape[0], math.prod(shape[1:])), shape


def use_stored_layers(module: torch.nn.Module, stored: dict[str, StoredTensor]
                      ) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Replace each ``nn.Linear`` and ``nn.Conv2d`` of ``module`` whose weight ``stored`` names (live weight name ->
    StoredTensor) by a QuantizedLinear or QuantizedConv2d of that format. Returns (the stored weights of other
    modules, which the caller dequantizes when loading; (name, logical shape, the module's shape) for each
    layer of another shape than its stored weight)."""
    others, mismatched = [], []
    for name, tensor in stored.items():
        shape = tuple(tensor.shape)
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        if leaf != "weight" or type(owner) not in (torch.nn.Linear, torch.nn.Conv2d):
            others.append(name)
            continue
        if type(owner) is torch.nn.Linear:
            needed = (owner.out_features, owner.in_features)
            if shape != needed:
                mismatched.append((name, shape, needed))
                continue
            bias = owner.bias
            replacement = QuantizedLinear(owner.in_features, owner.out_features, tensor, bias=bias is not None,
                                          bias_dtype=bias.dtype if bias is not None else torch.float32,
                                          device=owner.weight.device)
        else:
            flat, needed = _conv_shapes(owner)
            if shape not in (flat, needed):
                mismatched.append((name, shape, needed))
                continue
            replacement = QuantizedConv2d(owner, stored=tensor)
        parent_path, _, child = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, child, replacement)
    return others, mismatched


@contextlib.contextmanager
def logical_weights(modules) -> Iterator[None]:
    """Within the block, every quantized layer of ``modules`` shows a weight of its logical shape (a convolution's
    4-D; no memory: one zero, expanded) in its bias's dtype, for code that reads a layer's weight to size or
    place what it adds to it: a LoRA loader sizes its matrices from ``weight.shape`` and puts them on
    ``weight``'s device and dtype."""
    swapped = []
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, StoredWeightLayer):
                dtype = layer.bias.dtype if layer.bias is not None else torch.float32
                swapped.append((layer.weight, layer.weight.data))
                layer.weight.data = torch.zeros((), dtype=dtype, device=layer.weight.device).expand(
                    layer.logical_shape)
    try:
        yield
    finally:
        for weight, data in swapped:
            weight.data = data
