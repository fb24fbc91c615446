"""``--quantize NAME=TYPE``: a component of a model quantized on the fly, once, then read as a quantized file.

The quantized weights are written into memfit's cache, keyed by the component's content fingerprint and
the type (memfit.quant.writers says which layers and how), so a second run maps the file and never
quantizes again; the model then reads the component from that file as it reads a user's GGUF or fp8 file
(``--component``): stored bytes in every tier, dequantized one layer at a time. ``memfit plan`` sizes the
quantized component without writing anything, from the same choice of layers on the meta device.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.plan.meta import build_on_meta, measure_module
from memfit.quant.formats import FP8_FORMATS, INT8_FORMAT, StoredTensor, readable_gguf_types
from memfit.quant.layers import use_stored_layers
from memfit.quant.writers import (
    GGUF_TYPES,
    QUANTIZE_TYPES,
    SMALL_WEIGHT_ELEMENTS,
    quantized_layers,
    write_quantized,
)

__all__ = ["check_quantize", "plan_quantized", "with_quantized"]

CACHE_KIND = "quantized"
# Bump when what write_quantized writes changes: older entries then miss. 3: convolutions quantized too.
WRITER_VERSION = "3"


def check_quantize(model: ModelFolder, quantize: dict[str, str]) -> dict[str, str]:
    """``quantize`` (component -> type) with each type in lower case; one sentence for an unknown type, a component
    the model does not have or that has no weights, and one already stored quantized in its file."""
    if not isinstance(quantize, dict):
        raise MemfitError(f"quantize must map a component name to a type, e.g. {{'transformer': 'q8_0'}}; got "
                          f"{quantize!r}.")
    checked = {}
    for name, kind in quantize.items():
        kind = str(kind).strip().lower()
        if kind not in QUANTIZE_TYPES:
            raise MemfitError(f"--quantize {name}={kind}: memfit quantizes to {', '.join(QUANTIZE_TYPES)}; give one of "
                              "them (or a file already quantized with --component).")
        if name not in model.model_components:
            raise MemfitError(f"--quantize {name}={kind}: {model.path} has no model component {name!r}; the "
                              f"components memfit quantizes are: {model.listed_model_components()}.")
        if kind == "fp8" and not FP8_FORMATS:
            raise MemfitError(f"--quantize {name}=fp8 needs a torch with fp8 dtypes (2.1 or newer); this is "
                              f"{torch.__version__}.")
        weights = getattr(model, "weights", {}).get(name)
        if weights is not None and any(key in weights.checkpoint.stored for key in weights.keys()):
            raise MemfitError(f"--quantize {name}={kind}: {weights.path} is already quantized; leave out --quantize "
                              f"for {name}.")
        checked[name] = kind
    return checked


def _meta_quantized(model: ModelFolder, name: str, kind: str) -> torch.nn.Module:
    """Component ``name`` of ``model`` on the meta device as it loads quantized to ``kind``; refused, saying why,
    when no layer of it would be stored smaller."""
    library, class_name = model.components[name]
    module = build_on_meta(library, class_name, model.configs[name])
    layers = quantized_layers(module, kind)
    # The layers a run keeps stored (memfit.quant.layers swaps exactly these types; fp8 may choose others, which
    # are dequantized when loaded and sized so here).
    kept_stored = {path: layer for path, layer in layers.items() if type(layer) in (torch.nn.Linear, torch.nn.Conv2d)}
    if not kept_stored:
        if kind == "fp8":
            what = "linear or convolution layer outside its norms and embeddings"
        else:
            rows = "" if kind == "int8" else " whose rows are whole blocks of the type"
            what = (f"linear or convolution layer{rows} of more than {SMALL_WEIGHT_ELEMENTS} values outside its "
                    "first and last layers (embedders, input and output)")
        raise MemfitError(f"--quantize {name}={kind}: {name} ({class_name}) has no {what}, which is what memfit "
                          "stores quantized, so it would not be smaller; leave it out.")
    if kind == "fp8":
        fmt = next(iter(FP8_FORMATS.values()))
    elif kind == "int8":
        fmt = INT8_FORMAT  # its scales (4 bytes a row) are held beside the weight, not in the module's tensors
    else:
        fmt = next(f for f in readable_gguf_types().values() if f.name == GGUF_TYPES[kind])
    # As the file holds them: fp8 in each weight's own shape, the others a convolution's flattened to its rows.
    use_stored_layers(module, {f"{path}.weight": StoredTensor(fmt, tuple(layer.weight.shape) if kind == "fp8"
                                                              else (layer.weight.shape[0], layer.weight[0].numel()))
                               for path, layer in kept_stored.items()})
    return module


def plan_quantized(model: ModelFolder, quantize: dict[str, str] | None) -> ModelFolder:
    """``model`` planned with the components of ``quantize`` at their quantized size (nothing written)."""
    for name, kind in check_quantize(model, quantize or {}).items():
        module = _meta_quantized(model, name, kind)
        model.adapter.measured_sizes[name] = functools.partial(measure_module, name, module)
    return model


def with_quantized(model: ModelFolder, quantize: dict[str, str] | None, *, allow_pickle: bool = False) -> ModelFolder:
    """``model`` with each component of ``quantize`` read from its quantized file in memfit's cache, written first
    (with a progress line) where it is not there yet."""
    from memfit.models.single_file import SingleFileModel

    if not quantize:
        return model
    files = {}
    for name, kind in check_quantize(model, quantize).items():
        _meta_quantized(model, name, kind)  # refuses a component with nothing to quantize before any work
        files[name] = _cached_file(model, name, kind)
    return SingleFileModel.with_components(model, files, allow_pickle=allow_pickle, quantized=quantize)


def _cached_file(model: ModelFolder, name: str, kind: str) -> Path:
    import sys

    from memfit.cache import CacheKey, open_store

    key = CacheKey(CACHE_KIND, {"weights": model.component_fingerprint(name), "type": kind, "writer": WRITER_VERSION,
                                "class": model.components[name][1]})

    def build(folder: Path):
        print(f"memfit: quantizing {name} to {kind} (once; kept in memfit's cache)", file=sys.stderr, flush=True)
        module = model.load_stage([name], torch.float32, in_file_dtype=[name]).components[name]
        path = write_quantized(module, kind, folder)
        return {"component": model.components[name][1], "type": kind, "file": path.name}

    entry = open_store().get_or_build(key, build)
    return next(path for path in sorted(entry.iterdir()) if path.suffix in (".gguf", ".safetensors"))
