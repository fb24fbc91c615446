import subprocess
import sys
import types

import pytest

import memfit


def test_all_is_every_public_name_and_is_pinned():
    # Whatever memfit offers is public, so __all__ must name it, and nothing else; changing the public
    # surface is a decision: update EXPECTED_ALL on purpose. The names load on first use (PEP 562), so
    # what memfit offers is what dir() lists, each fetched here. Submodules (memfit.run, ...) are
    # attributes too, and dunders are the module's own, __version__ aside.
    public = [name for name in dir(memfit) if not isinstance(getattr(memfit, name), types.ModuleType)
              and (not name.startswith("_") or name == "__version__")]
    assert sorted(memfit.__all__) == sorted(public) == sorted(EXPECTED_ALL)


def test_every_public_name_comes_from_its_module():
    import memfit.run.generate

    assert memfit.generate is memfit.run.generate.generate
    from memfit import Budget, generate  # noqa: F401 - `from memfit import` goes through the same look-up

    with pytest.raises(AttributeError, match="has no attribute 'generat'"):
        memfit.generat  # noqa: B018


def test_import_stays_lean():
    # torch alone takes seconds to import: `import memfit` (and the CLI's help) must not pay for it.
    heavy = ("torch", "diffusers", "transformers", "openvino", "onnxruntime")
    code = f"import sys, memfit; print(','.join(m for m in {heavy!r} if m in sys.modules))"
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
