import subprocess
import sys
import types

import memfit


def test_all_is_every_public_name_and_is_pinned():
    # Whatever memfit/__init__.py binds is public, so __all__ must name it, and nothing else; changing
    # the public surface is a decision: update EXPECTED_ALL on purpose. Submodules (memfit.run, ...)
    # are attributes too, and dunders are the module's own, __version__ aside.
    public = [name for name, value in vars(memfit).items() if not isinstance(value, types.ModuleType)
              and (not name.startswith("_") or name == "__version__")]
    assert sorted(memfit.__all__) == sorted(public) == sorted(EXPECTED_ALL)


def test_import_stays_lean():
    code = "import sys, memfit; print(','.join(m for m in ('diffusers', 'transformers', 'openvino', 'onnxruntime') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`import memfit` imported {out}"


EXPECTED_ALL = [
    "Budget",
    "Embeddings",
    "Generation",
    "MemfitError",
    "RunReport",
    "StageReport",
    "__version__",
    "encode",
    "generate",
    "optimize",
    "parse_size",
    "process_peak_rss",
    "restore",
]
