import subprocess
import sys

import memfit


def test_all_is_pinned():
    # Changing the public surface is a decision: update this list on purpose.
    assert sorted(memfit.__all__) == sorted(EXPECTED_ALL)
    for name in memfit.__all__:
        assert hasattr(memfit, name), name


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
