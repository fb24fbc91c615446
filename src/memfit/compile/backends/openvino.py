"""OpenVINO: capture the module with ``torch.export``, convert it to an OpenVINO model, run it in
OpenVINO's runtime, and keep the compiled model in memfit's store.

What is stored: given ``cache=`` (a store that is on) and a ``weights_fingerprint``, one entry
holding ``model.blob`` (the compiled model, from ``CompiledModel.export_model()``) and
``outputs.json`` (how to rebuild the module's output structure from OpenVINO's flat outputs, so
a cached start needs no eager call to learn it). The key covers the weights/entry fingerprint, the
graph, the input signature (shapes, dtypes), the OpenVINO device with its name and capabilities,
the OpenVINO properties (precision hint included), the openvino, torch and memfit versions, and
memfit's cache format. A start that finds the entry imports the blob from a memory map
(``Core.import_model``): no torch.export, no conversion, no OpenVINO transformation pipeline.
The blob rather than the IR (model.xml/.bin): importing it from a map was the fastest warm load
measured (SD1.5 UNet fp32, 2 shared CPUs under load: 3.5-4.9 s, against 4.4-6.9 s compiling the
IR and 15-17 s importing it from bytes, with 3 GB more peak memory), and it is what a GPU needs
to skip kernel compilation. Without a store (``cache=None``, MEMFIT_CACHE=0, or no fingerprint)
nothing is stored and the IR of the build below goes to a temporary directory; MEMFIT_CACHE=require
raises on a missing entry instead of compiling.

A cold build goes through an IR on disk, so that no two copies of the weights are in memory at once
(_build): capture and convert (the converted model's constants share the torch weights' memory), save
the IR and drop the capture and the converted model, let the torch weights go back to their files (the
request's before_load hook), compile from the IR read back memory-mapped (a map of memfit's own) while dropping
its pages from the process (the plugin copies every weight into a layout of its own), and export the
blob straight to the entry's file (_FileStream). The compiled model serves the run that built it; the
IR is removed, the entry holds the blob. Built in memory instead, the mapped torch weights, the compiled
model and the exported stream were alive together: SD 1.5 UNet fp32 (3.2 GiB) peaked at 10.4 GiB, 4.2
GiB this way (docs/openvino_memory_cold.md).

OpenVINO's own caches stay refused, because memfit must be the only writer of what it loads:

* ``model_caching`` (an option of OpenVINO's torch.compile backend) swapped weights for fake
  tensors and broke the second generation.
* ``CACHE_DIR`` makes OpenVINO write blobs it names itself (its key of an in-memory model also
  differs from that of the same model read back from IR, so it recompiles), outside memfit's
  checksums and eviction; and with openvino 2026.4 a model that OpenVINO loaded from its
  CACHE_DIR exports a stream that ``import_model`` cannot read.

Learned on openvino 2026.4, torch 2.13, CPU:

* The CPU plugin quantizes the activations of layers with compressed weights (memfit's quantized layers:
  openvino_compressed) to int8 by default (DYNAMIC_QUANTIZATION_GROUP_SIZE 32), which moves their outputs by
  about 1% of their scale; memfit sets it to 0 (_DEFAULT_CONFIG) unless the config sets it.
* The CPU plugin defaults to bf16 inference on CPUs that support it, also when importing a blob
  compiled for f32: ``INFERENCE_PRECISION_HINT`` is pinned to the dtype the model runs in, at
  compile and at import, so fp32 stays fp32.
* ``convert_model`` of an ExportedProgram marks input dimensions dynamic; the model is reshaped to
  the example shapes (static shapes compile to faster kernels; calls are checked against them).
* ``torch.jit.trace`` (convert_model's default for a module) refuses a function that closes over
  parameters needing grad, which is what memfit.compile.entry_points hands over; ``torch.export`` takes it.
* Nothing here imports ``openvino.torch`` (OpenVINO's torch.compile backend, which changes a
  dynamo setting for the whole process); capture and conversion still run inside
  ``preserved_torch_settings()``, so nothing torch.export or the frontend sets leaks out.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import io
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from memfit.compile.backends._common import check_signature, graph_id, run_dtype, tensor_signature, uses_store
from memfit.compile.backends.base import Availability, Backend, CompileRequest
from memfit.compile.backends.openvino_compressed import COMPRESSED_FORMATS, compressed_for_export, pack_u4
from memfit.compile.backends.outputs import plain_outputs
from memfit.compile.backends.output_layout import LAYOUT_FILE, FlatOutputs, OutputLayout, name_of
from memfit.compile.backends.torch_settings import preserved_torch_settings
from memfit.errors import MemfitError

MODEL_FILE = "model.blob"
# Where a cold build saves the IR it compiles from, inside the entry it builds; removed before the entry is stored.
IR_DIR = "ir"
# Part of the key; bump it when what an entry holds changes, so older entries miss, not misread.
_ENTRY_FORMAT = "openvino-export/1"

_PRECISION_HINTS = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16",
                    "fp32": "f32", "fp16": "f16", "bf16": "bf16"}
# Properties memfit sets unless the user's config does. DYNAMIC_QUANTIZATION_GROUP_SIZE 0: the CPU plugin would
# quantize the activations of a layer with compressed weights to int8 (groups of 32), which moved Flux-width
# layers' outputs by about 1% of their scale (docs/openvino_quantized.md); layers with float weights it leaves alone.
_DEFAULT_CONFIG = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
# Properties that would make OpenVINO (or its torch.compile backend) cache on its own; see above.
_REFUSED_CONFIG = {
    "model_caching": "it replaces weights with fake tensors and breaks the second run",
    "CACHE_DIR": "OpenVINO would write files outside memfit's checksummed store",
}


class OpenVINOBackend(Backend):
    name = "openvino"
    float32_tolerance = 1e-4
    holds_own_weights = True  # the CPU plugin repacks every weight into memory of its own
    has_own_precision = True  # INFERENCE_PRECISION_HINT
    stored_formats = COMPRESSED_FORMATS  # kept compressed: memfit.compile.backends.openvino_compressed
    default_options: Mapping[str, Any] = {
        "device": "CPU",  # OpenVINO device: "CPU", "GPU" (Intel iGPU/dGPU), "NPU"
        # OpenVINO properties; INFERENCE_PRECISION_HINT defaults to the run dtype, DYNAMIC_QUANTIZATION_GROUP_SIZE to 0
        "config": {},
        # Free the model's intermediate buffers after each call (CompiledModel.release_memory). For a
        # component compiled as many block models (memfit.compile.entry_points.compile_blocks), each of
        # which would otherwise keep its own: measured on the SD 1.5 UNet's blocks, 0.29 GiB less at the
        # same speed.
        "release_memory": False,
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

    def held_precision(self, dtype: str) -> str:
        # A device that cannot compute in the hinted precision (a CPU without AVX-512 BF16 or AMX asked for bf16)
        # runs, and holds its weights, in f32: twice the bytes a bf16 run would plan with.
        wanted = super().held_precision(dtype)
        capabilities = _capabilities(self.resolve_options(None)["device"])
        if wanted == "fp32" or not capabilities or wanted.upper() in capabilities:
            return wanted
        return "fp32"

    def compile(self, request: CompileRequest) -> Callable[..., Any]:
        opts = self.resolve_options(request.options)
        self.require_available()
        _refuse_own_caching(opts["config"])
        fn, example_inputs = request.fn, request.example_inputs
        signature = tensor_signature(self.name, example_inputs)
        device = opts["device"]
        hint = _PRECISION_HINTS[self.precision] if self.precision else _precision_hint(example_inputs)
        ov_config = {"INFERENCE_PRECISION_HINT": hint, **_default_config(device), **opts["config"]}
        module = request.module if request.module is not None or not isinstance(fn, torch.nn.Module) else fn

        if not uses_store(request.cache, request.weights_fingerprint):
            request.notify_build()
            # The IR a build compiles from lives on disk for the build only: in a directory of its own here.
            with tempfile.TemporaryDirectory(prefix="memfit-openvino-ir-", ignore_cleanup_errors=True) as ir_dir:
                compiled, layout, _, weights = _build(fn, example_inputs, device, ov_config, Path(ir_dir),
                                                      request.notify_load, module)
            return _runner(compiled, layout, signature, keep_alive=weights, release_memory=opts["release_memory"])

        key = _cache_key(request.weights_fingerprint, graph_id(fn), signature, device, ov_config)
        built: list[tuple[Any, OutputLayout, Any]] = []

        def build(out_dir: Path) -> dict[str, Any]:
            request.notify_build()
            compiled, layout, weights, meta = _build_entry(fn, example_inputs, device, ov_config, out_dir,
                                                           request.notify_load, module)
            built[:] = [(compiled, layout, weights)]
            return meta

        entry = request.cache.get_or_build(key, build)  # raises on a miss under MEMFIT_CACHE=require
        if built:  # built here: the model compiled from the IR serves, the blob just written is for later starts
            compiled, layout, weights = built[0]
            return _runner(compiled, layout, signature, keep_alive=weights, release_memory=opts["release_memory"])
        request.notify_load()  # the torch weights go before the compiled model's own copy comes in
        compiled, layout, blob = _load_entry(entry, device, ov_config)
        return _runner(compiled, layout, signature, keep_alive=blob, release_memory=opts["release_memory"])


# -- options and keys ----------------------------------------------------------------------------


def _refuse_own_caching(config: Mapping[str, Any]) -> None:
    for name, why in _REFUSED_CONFIG.items():
        if name in config:
            raise MemfitError(
                f"OpenVINO's {name} is not supported by memfit: {why}. Remove it from the "
                "openvino backend's config; memfit stores compiled models itself (MEMFIT_CACHE_DIR)."
            )


@functools.lru_cache(maxsize=None)
def _default_config(device: str) -> dict[str, Any]:
    """_DEFAULT_CONFIG's properties that ``device`` has (a plugin refuses a property it does not know)."""
    try:
        supported = set(_core().get_property(device, "SUPPORTED_PROPERTIES"))
    except Exception:  # no such device: compiling says so
        return {}
    return {name: value for name, value in _DEFAULT_CONFIG.items() if name in supported}


@functools.lru_cache(maxsize=None)
def _capabilities(device: str) -> frozenset[str]:
    """What ``device`` computes in ("FP32", "BF16", "FP16", ...), or nothing where OpenVINO cannot say."""
    try:
        import openvino

        return frozenset(openvino.Core().get_property(device, "OPTIMIZATION_CAPABILITIES"))
    except Exception:  # not installed, or no such device: the hint is taken as given
        return frozenset()


def _precision_hint(example_inputs: Sequence[Any]) -> str:
    return _PRECISION_HINTS.get(str(run_dtype(example_inputs)), "f32")


def _cache_key(
    weights_fingerprint: str, graph: str, signature: list[list[Any]], device: str, ov_config: Mapping[str, Any]
) -> Any:
    from memfit.cache import compile_key

    return compile_key(
        weights_fingerprint=weights_fingerprint,
        graph=graph,
        input_signature=signature,
        backend="openvino",
        backend_options={
            "entry_format": _ENTRY_FORMAT,
            "device": device,
            "device_identity": _device_identity(device),
            "config": _json_config(ov_config),
        },
        backend_distributions=("openvino",),
    )


def _device_identity(device: str) -> dict[str, Any]:
    """What the compiled blob depends on besides the model: the device's model and instruction
    sets (a blob compiled for AVX-512 must not be imported on an AVX2 machine sharing the cache)."""
    core = _core()
    try:
        name = core.get_property(device, "FULL_DEVICE_NAME")
        capabilities = core.get_property(device, "OPTIMIZATION_CAPABILITIES")
    except RuntimeError as exc:
        raise MemfitError(
            f"OpenVINO device {device!r} is not usable here ({exc}); devices found: "
            f"{', '.join(core.available_devices) or 'none'}. Set the openvino backend's device option."
        ) from exc
    return {"name": str(name), "capabilities": sorted(str(c) for c in capabilities)}


def _json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    # OpenVINO's property values may be its own enums (e.g. hint.PerformanceMode.LATENCY), which
    # are not JSON; their str() is stable, so that is what the key holds.
    plain = (str, int, float, bool, type(None))
    return {str(k): v if isinstance(v, plain) else str(v) for k, v in config.items()}


# -- capture, convert, compile ------------------------------------------------------------------


def _convert(fn: Callable[..., Any], example_inputs: Sequence[Any]) -> tuple[Any, OutputLayout]:
    """``fn`` as a static-shape ov.Model, and the layout of its outputs."""
    import openvino as ov

    layouts: list[OutputLayout] = []
    wrapper = FlatOutputs("openvino", fn, layouts.append)
    # Distinct copies: given one tensor object twice, the converter drops one of the two inputs,
    # and the model would take fewer inputs than the callers pass.
    example = tuple(t.detach().clone() for t in example_inputs)
    with preserved_torch_settings(), torch.no_grad():
        try:
            exported = torch.export.export(wrapper, example, strict=False)
            model = ov.convert_model(exported)
        except MemfitError:
            raise
        except Exception as exc:
            raise MemfitError(
                f"Backend 'openvino' could not capture {name_of(fn)} with torch.export and convert "
                f"it ({type(exc).__name__}: {exc}). Use another backend for this component "
                "(e.g. backend='inductor' or 'eager')."
            ) from exc
    expected = list(exported.graph_signature.user_inputs)
    # A port can carry several names (an input the graph uses as is also takes its first use's name): any of them.
    if len(model.inputs) != len(expected) or any(name not in port.get_names()
                                                 for port, name in zip(model.inputs, expected)):
        raise MemfitError(
            f"OpenVINO converted {name_of(fn)} to a model with inputs "
            f"{[port.get_any_name() for port in model.inputs]}, not {expected}, so it cannot be "
            "fed positionally. Use another backend for this component (e.g. backend='inductor')."
        )
    model.reshape({port: ov.PartialShape(list(t.shape)) for port, t in zip(model.inputs, example_inputs)})
    return model, layouts[-1]


@functools.lru_cache(maxsize=None)
def _core() -> Any:
    """One OpenVINO Core per process, so each device plugin is loaded once."""
    import openvino as ov

    return ov.Core()


def _compile_model(model: Any, device: str, ov_config: Mapping[str, Any]) -> Any:
    try:
        return _core().compile_model(model, device, dict(ov_config))
    except RuntimeError as exc:
        raise MemfitError(
            f"OpenVINO could not compile the model for device {device!r} ({exc}). Check the "
            "openvino backend's device and config options, or use another backend."
        ) from exc


def _build(
    fn: Callable[..., Any], example_inputs: Sequence[Any], device: str, ov_config: Mapping[str, Any], ir_dir: Path,
    before_compile: Callable[[], None], module: Any = None,
) -> tuple[Any, OutputLayout, str, Any]:
    """Compile ``fn`` through an IR saved in ``ir_dir``: the compiled model, its output layout, the layout's JSON and
    the map of the IR's weights, which must live as long as the compiled model (see _read_ir).

    Built in memory, the capture, the converted model and the compiled model were alive together, each with
    the weights or a view of them (SD 1.5 UNet fp32: 10.36 GiB peak for 3.2 GiB of weights). Here each step
    lets the one before go: the converted model (whose constants share the torch weights' memory) is written
    out and dropped with the capture, ``before_compile`` lets the torch weights go (the caller's hook: they
    are mapped from the component's files, and their pages leave this process), and the plugin compiles from
    the IR read back memory-mapped, whose pages are dropped again and again while it copies the weights into
    its own layout (the whole file would stay resident beside that copy otherwise).
    ``module``: what ``fn`` calls, whose quantized layers are captured as compressed weights (_save_ir).
    """
    ir_dir.mkdir(parents=True, exist_ok=True)
    xml = ir_dir / "model.xml"
    layout = _save_ir(fn, example_inputs, xml, module)
    layout_json = layout.to_json()  # fails early, before compiling, on an output it cannot store
    gc.collect()  # torch.export's graphs hold their tensors in reference cycles
    before_compile()
    model, weights = _read_ir(xml)
    with _pages_dropped_meanwhile(weights):
        compiled = _compile_model(model, device, ov_config)
        del model
    _drop_pages(weights)
    return compiled, layout, layout_json, weights


def _read_ir(xml: Path) -> tuple[Any, Any]:
    """The IR at ``xml`` as an ov.Model whose weights are a private map of its .bin (returned too: what the model
    reads, and what the caller drops pages of, keeping it alive as long as anything compiled from the model)."""
    import numpy as np
    import openvino as ov

    weights_file = xml.with_suffix(".bin")
    try:
        if not weights_file.stat().st_size:  # no weight at all: nothing to map
            return _core().read_model(str(xml)), None
        # Mapped by memfit rather than by OpenVINO (ENABLE_MMAP), so that the pages the plugin has read can be
        # dropped from a mapping that is known to stay in place. Copy-on-write: ov.Tensor wants a writable array.
        weights = np.memmap(weights_file, dtype=np.uint8, mode="c")
        return _core().read_model(xml.read_text(encoding="utf-8"), ov.Tensor(weights, shared_memory=True)), weights
    except (OSError, RuntimeError) as exc:
        raise MemfitError(f"OpenVINO could not read back the IR it saved in {xml.parent} ({exc}).") from exc


def _save_ir(fn: Callable[..., Any], example_inputs: Sequence[Any], xml: Path, module: Any = None) -> OutputLayout:
    """Capture and convert ``fn``, write it as IR at ``xml`` (and its .bin), and return its output layout;
    the capture and the converted model are gone when this returns. The quantized layers of ``module`` that
    OpenVINO keeps compressed are captured as its decompression pattern (openvino_compressed), whose tensors
    live until the IR is written."""
    import openvino as ov

    with compressed_for_export(module) as compressed:
        model, layout = _convert(fn, example_inputs)
        if compressed:
            pack_u4(model)  # Q4_0's values, uint8 in torch: half a byte each in the IR, as stored
        try:
            # Weights as they are: save_model compresses floating point weights to f16 unless told not to.
            ov.save_model(model, str(xml), compress_to_fp16=False)
        except RuntimeError as exc:
            raise MemfitError(
                f"OpenVINO could not save {name_of(fn)} as IR in {xml.parent} ({exc}); check the free space there "
                "(MEMFIT_CACHE_DIR, or the temporary directory without a store)."
            ) from exc
        del model  # its Constants share the prepared tensors' memory
    return layout


class _FileStream(io.BytesIO):
    """A file behind the io.BytesIO that ``CompiledModel.export_model`` insists on: the binding writes through
    ``write()`` piece by piece (a header, then one constant at a time) and seeks back to fill in the header's
    offsets, so with both sent to the file the exported model is never whole in memory (a plain BytesIO held a
    third copy of the weights, beside the compiled model and the converted one)."""

    def __init__(self, handle: Any):
        super().__init__()
        self._handle = handle

    def write(self, data: Any) -> int:
        return self._handle.write(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def flush(self) -> None:
        self._handle.flush()


def _build_entry(
    fn: Callable[..., Any], example_inputs: Sequence[Any], device: str, ov_config: Mapping[str, Any], out_dir: Path,
    before_compile: Callable[[], None], module: Any = None,
) -> tuple[Any, OutputLayout, Any, dict[str, Any]]:
    """Build and write the store entry's files into ``out_dir`` (the store's staging directory): the compiled
    model, its output layout, the map of the IR's weights it reads (see _build) and the manifest's metadata. The IR it compiles from is removed again: the entry
    holds the exported blob, which later starts import (see the module doc)."""
    ir_dir = out_dir / IR_DIR
    compiled, layout, layout_json, weights = _build(fn, example_inputs, device, ov_config, ir_dir, before_compile, module)
    # The export reads the weights back from the mapped IR (the CPU plugin exports the model it compiled from),
    # whose pages are let go again as it goes.
    with (out_dir / MODEL_FILE).open("wb") as handle, _pages_dropped_meanwhile(weights):
        stream = _FileStream(handle)
        try:
            compiled.export_model(stream)
        except RuntimeError as exc:
            raise MemfitError(
                f"OpenVINO device {device!r} cannot export compiled models ({exc}), so memfit cannot "
                "store them: run with MEMFIT_CACHE=0, or use device='CPU'."
            ) from exc
        if stream.getbuffer().nbytes:  # a binding that wrote into the buffer itself, not through write(): that
            handle.seek(0)
            handle.truncate()
            handle.write(stream.getbuffer())
    _drop_pages(weights)
    shutil.rmtree(ir_dir, ignore_errors=True)  # its map stays readable (Linux), and goes with the compiled model
    (out_dir / LAYOUT_FILE).write_text(layout_json, encoding="utf-8")
    return compiled, layout, weights, {"outputs": layout.tensor_count, "device": device}


def _load_entry(entry: Path, device: str, ov_config: Mapping[str, Any]) -> tuple[Any, OutputLayout, Any]:
    """Import a verified store entry (``entry`` comes from the store, which checked every file).

    Returns the compiled model, the output layout, and the mapped blob, which must outlive the
    compiled model: a model imported from shared memory keeps pointing into it (freeing the map
    first crashes the first inference).
    """
    import numpy as np
    import openvino as ov

    layout = OutputLayout.load("openvino", entry)
    # Map the blob instead of reading it: the weights are not copied, and stay in the page cache
    # the checksum just filled. Copy-on-write ("c") because ov.Tensor wants a writable array;
    # the file itself is never written (store entries are replaced by rename, never in place).
    blob = np.memmap(entry / MODEL_FILE, dtype=np.uint8, mode="c")
    try:
        # The precision hint again: without it the CPU plugin imports an f32 blob as bf16.
        with _pages_dropped_meanwhile(blob):
            compiled = _core().import_model(ov.Tensor(blob, shared_memory=True), device, dict(ov_config))
    except RuntimeError as exc:
        raise MemfitError(
            f"OpenVINO could not import the stored model {entry / MODEL_FILE} ({exc}). Remove it "
            "with `memfit cache clear --kind compiled` so that it is compiled again."
        ) from exc
    _drop_pages(blob)
    return compiled, layout, blob


@contextlib.contextmanager
def _pages_dropped_meanwhile(blob: Any, every_seconds: float = 0.05) -> Iterator[None]:
    """Drop the blob's pages from this process again and again while the block runs: the import reads
    the blob once, front to back, into memory of the plugin's own, so the pages it has read are not
    needed, and without this the whole blob stays resident beside that copy until the import ends
    (measured on the SD 1.5 UNet, 1.72 GB in bf16: peak RSS 3.39 GiB without, 1.81 GiB with, import
    1.0 s either way). A page read again later comes back from the page cache; see _drop_pages. The same
    for a cold build's IR weights (_build), which compiling and exporting read front to back."""
    done = threading.Event()

    def drop_until_done() -> None:
        while not done.wait(every_seconds):
            _drop_pages(blob)

    dropper = threading.Thread(target=drop_until_done, name="memfit-openvino-import", daemon=True)
    dropper.start()
    try:
        yield
    finally:
        done.set()
        dropper.join()


def _drop_pages(blob: Any) -> None:
    """Let the blob's pages go from this process once imported: the CPU plugin has repacked every
    weight into its own memory, so the map is read again only for the little it uses in place
    (measured on a 545 MB UNet: resident set 1.48 GB after import, 0.93 GB after this, 1.03 GB
    after inference, outputs unchanged). The pages stay in the page cache, reclaimable; the
    mapping is private and never written, so dropping them loses nothing."""
    import mmap

    mapping = getattr(blob, "_mmap", None)
    if mapping is not None and hasattr(mapping, "madvise"):
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


# -- running ---------------------------------------------------------------------------------------


def _runner(
    compiled: Any, layout: OutputLayout, signature: list[list[Any]], keep_alive: Any = None,
    release_memory: bool = False,
) -> Callable[..., Any]:
    """The callable compile() returns; ``keep_alive`` (what the compiled model reads from) lives
    as long as it does."""
    request = compiled.create_infer_request()
    # One infer request reuses its output buffers; calls from two threads must not interleave.
    lock = threading.Lock()
    count = len(compiled.outputs)

    def run(*args: Any) -> Any:
        check_signature("openvino", args, signature)
        feeds = [_to_openvino(a) for a in args]
        with lock:
            request.infer(feeds)
            outputs = [_to_torch(request.get_output_tensor(i)) for i in range(count)]  # copies
            if release_memory:
                compiled.release_memory()
        return plain_outputs(layout.rebuild(outputs))

    def release_buffers() -> None:
        with lock:
            compiled.release_memory()

    run.release_buffers = release_buffers  # type: ignore[attr-defined]  (see entry_points.release_buffers)
    run.compiled_model = compiled  # type: ignore[attr-defined]  (for inspection and tests)
    run._keep_alive = keep_alive  # type: ignore[attr-defined]
    return run


def _to_openvino(tensor: Any) -> Any:
    import openvino as ov

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: hand over the bits
        return ov.Tensor(tensor.view(torch.int16).numpy(), list(tensor.shape), ov.Type.bf16)
    return tensor.numpy()


def _to_torch(tensor: Any) -> Any:
    import numpy as np
    import openvino as ov

    # A copy: OpenVINO overwrites its output buffer on the next call, and the caller owns this.
    data = np.array(tensor.data)
    if tensor.element_type == ov.Type.bf16:  # numpy shows bf16 bits as float16; reinterpret
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)
