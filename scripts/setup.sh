#!/usr/bin/env bash
# Creates the virtual environment and installs memfit into it. Safe to run again.
#
# torch is installed only where the environment has none, and then pinned (TORCH_SPEC), so pip
# never resolves an unpinned torch: on Linux that would pull gigabytes of CUDA packages. pip takes
# it from its configured index; TORCH_INDEX names another (https://download.pytorch.org/whl/cpu for
# the CPU build on a stock Linux machine). GPU users install their CUDA build of torch into the
# environment first; this script keeps it.
#
# memfit itself is installed again only when pyproject.toml or the extras changed since the last
# set-up (a stamp in the environment), so `make demo` does not pay for pip each time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"
EXTRAS="${EXTRAS:-test}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no torch in $VENV; installing $TORCH_SPEC${TORCH_INDEX:+ from $TORCH_INDEX}"
    "$VENV/bin/pip" install --quiet ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
fi
STAMP="$VENV/.memfit-setup"
WANTED="$(cat pyproject.toml) extras=$EXTRAS source=$(pwd)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANTED" ] && "$VENV/bin/python" -c "import memfit" >/dev/null 2>&1; then
    echo "setup: memfit is installed with [$EXTRAS] and pyproject.toml has not changed; nothing to install"
else
    "$VENV/bin/pip" install --quiet -e ".[$EXTRAS]"
    printf '%s' "$WANTED" > "$STAMP"
fi
"$VENV/bin/python" -c "import memfit, torch; print(f'setup: memfit {memfit.__version__}, torch {torch.__version__}')"
