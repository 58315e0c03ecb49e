#!/usr/bin/env bash
# The GPU check rehearsed on a replica of the GPU machine's software, on a CPU (a stage of .ci/run):
#
#     bash benchmarks/gpu_replica.sh            # from the repository root; the venv goes to .venv-gpu (VENV=...)
#
# 1. A virtual environment with Python 3.12 and exactly the GPU machine's packages that the project or its tests touch
#    (benchmarks/gpu_machine.txt: torch 2.11.0 is the registry's CUDA build, with its NVIDIA libraries; it imports and
#    runs on a CPU), then the packages that machine lacks removed (LACKS, and every carried one): what its packages
#    pulled in must not hide a package the carried wheels do not bring. The project is not installed: it runs from
#    src/ on PYTHONPATH, as there.
# 2. The carried wheels (benchmarks/gpu_wheels.py, with network), and their size with the working tree.
# 3. `DEVICE=cpu CONFIG=tiny bash benchmarks/gpu_check.sh` in that environment and in a network namespace of its own
#    (no network, loopback up), as on the GPU machine. Its exit status is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-gpu-check-replica}
# On the GPU machine's list of what it lacks (../shared/gpu-machine.md), with what the carried wheels bring besides.
LACKS="soundfile soxr fastapi fastapi-offline starlette pydantic pydantic-core uvicorn websockets python-multipart av datasets
bitsandbytes kernels gradio"

python312() {  # a Python 3.12: on PATH, else one that pyenv has
    local candidate
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2> /dev/null; then
            command -v "$candidate"
            return
        fi
    done
    echo "no Python 3.12 here: the replica needs the GPU machine's Python (3.12)" >&2
    return 1
}

marker="$VENV/.gpu-machine-$(sha256sum benchmarks/gpu_machine.txt benchmarks/gpu_wheels.txt | sha256sum | cut -c1-12)"
if [ ! -e "$marker" ]; then
    echo "+ the replica's venv ($VENV): $(python312) and benchmarks/gpu_machine.txt"
    rm -rf "$VENV"
    "$(python312)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -r benchmarks/gpu_machine.txt
    carried=$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' benchmarks/gpu_wheels.txt)
    # shellcheck disable=SC2086  # word splitting wanted: one name each
    "$VENV/bin/python" -m pip uninstall -q -y $LACKS $carried 2>&1 | { grep -v "not installed" || true; }
    touch "$marker"
fi
"$VENV/bin/python" -m pip list --format=freeze > "$VENV/packages.txt"
echo "+ the replica has $(wc -l < "$VENV/packages.txt") packages ($VENV/packages.txt)"

echo "+ the carried wheels"
"$VENV/bin/python" benchmarks/gpu_wheels.py

echo "+ DEVICE=cpu CONFIG=tiny bash benchmarks/gpu_check.sh, offline, with $VENV/bin/python"
rm -rf "$OUT"
unshare --net bash -c 'ip link set lo up && exec "$@"' bash \
    env PATH="$PWD/$VENV/bin:$PATH" PYTHON="$PWD/$VENV/bin/python" OUT="$OUT" SITE="$PWD/$VENV/carried" \
    DEVICE=cpu CONFIG=tiny OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" bash benchmarks/gpu_check.sh
