"""The command starts at once: help and argument errors import neither torch nor diffusers (seconds of
imports on a small machine), nor does ``import memfit`` (issue 35, item 13). Each case runs in a fresh
process, where sys.modules shows what was imported; a time would only measure the machine."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "diffusers", "transformers")

# `memfit ARGS` in a fresh process: the exit status, then the heavy modules that were imported.
_RUN = """
import sys
from memfit.cli.app import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print(status, ",".join(name for name in {heavy!r} if name in sys.modules))
"""


def _heavy_imports(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", _RUN.format(heavy=HEAVY), *args], capture_output=True, text=True,
                          check=True)
    status, _, imported = done.stdout.strip().rpartition("\n")[2].partition(" ")
    return int(status), imported


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["generate", "--help"], ["encode", "--help"], ["plan", "--help"], ["serve", "--help"],
    ["batch", "--help"], ["cache", "--help"], ["cache", "ls", "--help"],
], ids=" ".join)
def test_help_imports_no_torch(args):
    assert _heavy_imports(*args) == (0, "")


@pytest.mark.parametrize("args", [
    ["generate", "--prompt", "x", "--bogus"],  # argparse's refusal
    ["generate", "--prompt", "x", "--budget", "banana"],
    ["generate", "--prompt", "x", "--steps", "0"],
    ["generate", "--prompt", "x", "--guidance", "nan"],
    ["generate", "--prompt", "x", "--timeline", "run.txt"],
    ["generate", "--prompt", "x", "--component", "vae"],
    ["generate"],  # nothing to draw
    ["generate", "--prompt", "x", "--model", "/no/such/model"],
    ["generate", "--prompt", "x", "--model", "/no/such/model.safetensors"],
    ["plan", "--model", "/no/such/model"],
    ["encode", "--prompt", "x", "--out", "embeddings.txt"],
    ["plan", "--arch", "sdxl", "--budget", "banana"],
    ["serve", "--port", "-5"],
    ["batch", "jobs.jsonl", "--out", "out", "--steps", "0"],
], ids=" ".join)
def test_a_refusal_that_needs_no_model_imports_no_torch(args):
    assert _heavy_imports(*args) == (2, "")


def test_import_memfit_imports_no_torch_and_its_names_still_work():
    code = ("import sys, memfit; lean = 'torch' not in sys.modules; "
            "from memfit import generate; print(lean, memfit.generate is generate, callable(generate))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]
