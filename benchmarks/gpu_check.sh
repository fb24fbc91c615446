#!/usr/bin/env bash
# memfit's GPU check in one command (benchmarks/gpu_check.py says what it measures): about 2.5 minutes on a
# bare machine with one H100 or H200, python3 and a CUDA build of torch there; it writes docs/gpu_check.json
# and docs/gpu_check.md.
#
#   bash benchmarks/gpu_check.sh                           # on the GPU machine, from the repository's root
#   bash benchmarks/gpu_check.sh --fake --out-dir /tmp/x   # no GPU: a dry run on memfit's fake CUDA runtime
#
# A machine that cannot reach a package registry takes the packages it lacks (diffusers, at least) as wheels
# in .whl/ at the repository's root; they are installed into a folder of their own, not the system's
# (docs/gpu.md says how to fetch them). Extra arguments go to gpu_check.py; GPU_CHECK_TIMEOUT (seconds,
# default 480) bounds the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import diffusers" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/memfit-wheels .whl/*.whl
        export PYTHONPATH="/tmp/memfit-wheels${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_check: diffusers is not installed and .whl/ holds no wheels; see docs/gpu.md" >&2
        exit 2
    fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec timeout --signal=INT --kill-after=20 "${GPU_CHECK_TIMEOUT:-480}" "$python" benchmarks/gpu_check.py "$@"
