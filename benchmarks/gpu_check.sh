#!/usr/bin/env bash
# The GPU check, for a lent GPU machine with no network (docs/performance.md, "The GPU check"):
#
#     python benchmarks/gpu_wheels.py                 # here first: the wheels that machine lacks, into .whl/
#     OUT=$OUT bash benchmarks/gpu_check.sh           # there, the device call carrying .whl: every user path (<= 8 min)
#     OUT=$OUT PART=2 bash benchmarks/gpu_check.sh    # there, a second call if time is left: the CUDA tests, figures
#     DEVICE=cpu CONFIG=tiny bash benchmarks/gpu_check.sh   # the same stages on a CPU (CI's rehearsal: gpu_replica.sh)
#
# The first stage installs the carried wheels offline into SITE (on PYTHONPATH with src/ for the stages after it) and
# imports every package the project needs. Each later stage is one program with a time limit; the limits of a part sum
# to less than its BUDGET, and a stage gets at most what is left of it. A stage's items print PLAN, then PASS, FAIL
# or SKIP lines (benchmarks/gpu_paths.py); a stage without items passes when it exits 0. Each stage's output goes to
# the terminal and to a log as it is printed; benchmarks/gpu_summary.py then prints one table (stage, passed, failed,
# skipped, seconds, limit) and names every failed item: one cut off by its stage's limit is a FAIL "not reached".
# $OUT gets few files (the device tool brings back 8): check.log (every stage's output), summary.json, and part 2's
# figures as JSON. The script exits 1 when anything failed, 0 when everything passed.
#
# Part 1 (the user paths, most decisive first; limits from the CPU rehearsal with margin, docs/performance.md):
#   setup          the carried wheels installed; each package imported, with its version; the machine's facts
#   paths          every user path in bfloat16 (CLI piped, pipeline, synthesize, server, engine, streamer, job, LoRA)
#   paths-float32  greedy frames of the device against the CPU's, and the CLI, pipeline, engine, streamer in float32
#   graphs         fast_decode=True (CUDA graphs): frames equal to the eager step's, graph replays counted
#   compiled       compile_step=True, and fast_decode=True with compile_step=True and sampling (the defaults)
#   wide           real width, 4 layers, FP8-kept and 4-bit experts: generate, engine, streamer, codec encode
#   parallel       2-rank tensor parallel (skipped on one GPU)
# Part 2 (figures; run it when part 1 has passed and device time is left):
#   cuda-tests, frame-step (real size, full depth: eager and graph steps at batch 1 and 16, time to first audio,
#   memory), experts (FP8 kept / 4-bit / bf16 experts at real width), frame-step-compiled (8 layers).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-check}
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-real}
PART=${PART:-1}
BUDGET=${BUDGET:-470}
SITE=${SITE:-/tmp/drama3-site}
export PYTHONPATH="src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1  # the machine has no network
# No stored CPU steps (generation/stored_steps.py): on a CPU rehearsal their background compiles would compete with
# the timed stages; a GPU's paths never use them.
export DRAMA3_STEP_STORE=off
DEADLINE=$(( $(date +%s) + BUDGET ))
LOGS=$(mktemp -d)  # one log per stage, and stages.tsv: the summary's input
mkdir -p "$OUT"
: > "$LOGS/stages.tsv"
: > "$OUT/check.log"

stage() {  # stage NAME LIMIT COMMAND...: run COMMAND for at most LIMIT seconds (and what is left of BUDGET)
    local name=$1 limit=$2 left start status
    shift 2
    left=$(( DEADLINE - $(date +%s) ))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "=== $name not run: the budget of ${BUDGET}s is spent" | tee "$LOGS/$name.txt" >> "$OUT/check.log"
        printf '%s\t0\t0\tnot-run\n' "$name" >> "$LOGS/stages.tsv"
        return
    fi
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.txt"
    status=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$limit" "$(( $(date +%s) - start ))" "$status" >> "$LOGS/stages.tsv"
    echo "=== $name exit $status ($(date -u +%H:%M:%S))"
    { echo "=== $name (limit ${limit}s, exit $status): $*"; cat "$LOGS/$name.txt"; } >> "$OUT/check.log"
}

install_wheels() {  # the carried wheels, offline, into SITE; then every package imported
    if ! ls .whl/*.whl > /dev/null 2>&1; then
        echo "FAIL carried wheels: no .whl/ folder here (run python benchmarks/gpu_wheels.py before the device call, and carry .whl)"
    elif ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl; then
        echo "FAIL carried wheels: pip could not install .whl/*.whl into $SITE"
    else
        echo "PASS carried wheels: $(ls .whl/*.whl | wc -l) installed into $SITE"
    fi
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" benchmarks/gpu_wheels.py --check
}

paths() { stage "$1" "$2" "$PYTHON" benchmarks/gpu_paths.py --group "$1" --device "$DEVICE"; }

export -f install_wheels
export PYTHON SITE
stage setup 30 bash -c install_wheels
if [ "$PART" = 1 ]; then
    # The limits: about twice each stage's time in the CPU rehearsal on a quiet 2-core box (docs/performance.md, "The
    # GPU check"); `compiled` more (inductor compiles on a GPU, dynamo's eager backend on a CPU). They sum to 460 s.
    paths paths 120
    paths paths-float32 60
    paths graphs 50
    paths compiled 100
    paths wide 90
    paths parallel 10
else
    if [ "$DEVICE" = cuda ]; then
        stage cuda-tests 60 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_frame_step.py tests/test_engine.py \
            -k cuda -rs
    fi
    stage frame-step 150 "$PYTHON" benchmarks/frame_step.py --config "$CONFIG" --device "$DEVICE" \
        --modes "$([ "$DEVICE" = cuda ] && echo eager,graph || echo eager)" --batches 1,16 --warmup 3 --frames 16 \
        --ttfa-runs 2 --check-frames 12 --output "$OUT/frame-step.json"
    stage experts 70 "$PYTHON" benchmarks/expert_formats.py --config "$CONFIG" --device "$DEVICE" --layers 8 \
        --batches 1,16 --warmup 2 --frames 12 --output "$OUT/experts.json"
    stage frame-step-compiled 150 "$PYTHON" benchmarks/frame_step.py --config "$CONFIG" --device "$DEVICE" --layers 8 \
        --modes "$([ "$DEVICE" = cuda ] && echo eager,graph,compiled,compiled+graph || echo eager,compiled)" \
        --batches 1 --warmup 3 --frames 12 --ttfa-runs 1 --check-frames 8 --count-kernels --compile-layers 4,8 \
        --output "$OUT/frame-step-compiled.json"
fi
"$PYTHON" benchmarks/gpu_summary.py "$LOGS" "$OUT/summary.json" "part $PART, $DEVICE, budget ${BUDGET}s"
