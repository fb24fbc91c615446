"""OpenVINO's compressed weights: a component's quantized linear layers captured so that OpenVINO keeps them at
their stored size.

A layer that can be captured so has an ``openvino_pattern()`` method (memfit.quant.layers; the
pattern itself is memfit.quant.openvino_pattern) returning its weight, as a function of the compute dtype, in
tensors written as OpenVINO's decompression pattern, or None for a format OpenVINO does not keep compressed.
While torch.export captures the component, each such layer forwards through that function (its ``export_weight``)
instead of dequantizing its bytes; the CPU plugin then fuses the pattern into its FullyConnected, whose weight
input stays int8 (int8, GGUF Q8_0) or u4 (GGUF Q4_0: torch has no 4-bit dtype, so its values leave torch as uint8
and pack_u4 turns them into u4 Constants after the conversion, half a byte a value as stored).

The CPU plugin by default also quantizes the activations of such layers to int8, in groups of 32 (dynamic
quantization); memfit turns that off (memfit.compile.backends.openvino) unless the user's config sets it: measured
on Flux-width layers, it moved int8 and Q8_0 outputs by about 1% of their scale against the dequantized weights'
result (docs/openvino_quantized.md), where without it they match to float rounding.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["COMPRESSED_FORMATS", "compressed_for_export", "pack_u4"]

#: The stored formats (memfit.quant's StoredFormat.name) whose weights an OpenVINO model keeps compressed.
COMPRESSED_FORMATS = frozenset({"int8", "Q8_0", "Q4_0"})


@contextlib.contextmanager
def compressed_for_export(module: Any) -> Iterator[int]:
    """Within the block, each layer of ``module`` with an OpenVINO pattern forwards through it while torch.export
    traces it; yields how many do. The pattern's tensors go when the block ends: the converted model, whose
    Constants share their memory, must be saved (or dropped) inside it."""
    prepared = []
    for layer in module.modules() if module is not None else ():
        pattern = getattr(layer, "openvino_pattern", None)
        weight = pattern() if callable(pattern) else None
        if weight is not None:
            layer.export_weight = weight
            prepared.append(layer)
    try:
        yield len(prepared)
    finally:
        for layer in prepared:
            del layer.export_weight  # back to the class's None


def pack_u4(model: Any) -> int:
    """Replace each uint8 Constant of ``model`` whose values all fit four bits and that feeds only Converts (a
    Q4_0 layer's values) by a u4 Constant of the same values; returns how many. Lossless whatever made the
    Constant, so nothing needs to know which ones they are."""
    import openvino as ov
    from openvino import opset13

    replaced = 0
    for op in model.get_ops():
        if op.get_type_name() != "Constant" or op.get_element_type() != ov.Type.u8:
            continue
        consumers = op.output(0).get_target_inputs()
        if not consumers or any(c.get_node().get_type_name() != "Convert" for c in consumers):
            continue
        values = op.get_data()
        if values.size == 0 or int(values.max()) > 15:
            continue
        op.output(0).replace(opset13.constant(values, dtype=ov.Type.u4).output(0))
        replaced += 1
    return replaced
