#!/usr/bin/env bash
# Creates the virtual environment and installs memfit into it. Safe to run again.
#
# torch is installed only where the environment has none, and then pinned (TORCH_SPEC), so pip
# never resolves an unpinned torch: on Linux that would pull gigabytes of CUDA packages. GPU
# users install their CUDA build of torch into the environment first; this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-test}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no torch in $VENV; installing $TORCH_SPEC"
    "$VENV/bin/pip" install --quiet "$TORCH_SPEC"
fi
"$VENV/bin/pip" install --quiet -e ".[$EXTRAS]"
"$VENV/bin/python" -c "import memfit, torch; print(f'setup: memfit {memfit.__version__}, torch {torch.__version__}')"
