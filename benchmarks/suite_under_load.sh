#!/usr/bin/env bash
# Time the test suite on a busy machine: one busy-loop process per core runs beside it, the way other jobs load a
# shared CI machine. The numbers in docs/performance.md ("Test suite") come from this script.
#
#   bash benchmarks/suite_under_load.sh                     # python -m pytest -q --durations=20
#   bash benchmarks/suite_under_load.sh -n 2 --dist loadfile
#   HOGS=0 bash benchmarks/suite_under_load.sh              # the same without the busy loops
#
# Arguments go to pytest. Run it from the repository root inside the project's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=()
for _ in $(seq "${HOGS:-$(nproc)}"); do
    python3 -c "while True: pass" &
    hogs+=("$!")
done
trap '[ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}"' EXIT
echo "busy loops: ${#hogs[@]}; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
status=0
python -m pytest -q --durations=20 -p no:cacheprovider "$@" || status=$?
echo "wall: $(( $(date +%s) - start )) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg); $(date -u)"
exit "$status"
