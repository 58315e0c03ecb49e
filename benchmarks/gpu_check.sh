#!/usr/bin/env bash
# The one-shot GPU check, for a lent GPU machine with PyTorch, Triton and transformers preinstalled and no network:
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh          # from the repository root; src/ goes on PYTHONPATH
#
# The whole run fits one device call: BUDGET seconds (default 470) are shared by the stages below, most decisive
# first; each stage also has its own limit, and gets at most what is left of the budget. A stage that fails or runs
# out of time does not stop the next. Python runs unbuffered and every stage's output goes to $OUT/NAME.txt as it is
# printed (tee), so a stage cut off at its limit still leaves the figures it had printed.
#   1. machine facts;
#   2. every user path end to end (benchmarks/gpu_paths.py: the CLI with a reference and streaming, the pipeline,
#      synthesize with a saved voice, the server's routes, the engine with CUDA graphs, the compiled step, LoRA
#      steps, a manifest job, at the tiny geometry in float32 and bf16 and at real width with 4 layers, FP8 kept and
#      bnb 4-bit; greedy frames against the CPU's), one PASS or FAIL line each;
#   3. the CUDA tests (CUDA graph replay == eager frames, the codec on its own stream);
#   4. the frame step at real size, full depth: eager and CUDA-graph steps at batch 1 and 16, then time to first
#      audio (the first, cold call reported apart from the warm ones), peak memory against weights + caches, and the
#      same-frames check across modes (benchmarks/frame_step.py --config real);
#   5. the routed experts on the selected-experts path (FP8 kept, bitsandbytes 4-bit) against bf16 experts, at real
#      width and 8 layers, side by side (benchmarks/expert_formats.py; transformers' FP8 kernel needs `kernels` and
#      a Hub download: benchmarks/fp8_experts.py, by hand);
#   6. the compiled step at real width and 8 layers: eager, graph, compiled, compiled+graph side by side, and the
#      kernels per frame of the eager and the compiled step (compiling all 40 layers would not fit the budget; the
#      step's cost is about linear in the depth, see docs/performance.md).
# DEVICE=cpu CONFIG=tiny runs the same stages on a CPU with the tiny geometry (a dry run of this script).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-check}
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-real}
BUDGET=${BUDGET:-470}
DEADLINE=$(( $(date +%s) + BUDGET ))
mkdir -p "$OUT"

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (and what is left of BUDGET)
    local name=$1 seconds=$2 left
    shift 2
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 10 ]; then
        echo "=== $name skipped: the budget of ${BUDGET}s is spent" | tee "$OUT/$name.txt"
        return
    fi
    [ "$seconds" -gt "$left" ] && seconds=$left
    echo "=== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*"
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "=== $name exit ${PIPESTATUS[0]} ($(date -u +%H:%M:%S))"
}

stage machine 30 bash -c 'date -u; nvidia-smi || true; python -c "import torch, transformers, platform;
print(platform.platform(), \"python\", platform.python_version());
print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"cuda\", torch.cuda.is_available())"'
stage paths 90 python benchmarks/gpu_paths.py --device "$DEVICE"
if [ "$DEVICE" = cuda ]; then
    stage cuda-tests 60 python -m pytest -q -p no:cacheprovider tests/test_frame_step.py tests/test_engine.py -k cuda -rs
fi
stage frame-step 150 python benchmarks/frame_step.py --config "$CONFIG" --device "$DEVICE" \
    --modes "$([ "$DEVICE" = cuda ] && echo eager,graph || echo eager)" --batches 1,16 --warmup 3 --frames 16 \
    --ttfa-runs 2 --check-frames 12 --output "$OUT/frame-step.json"
stage experts 70 python benchmarks/expert_formats.py --config "$CONFIG" --device "$DEVICE" --layers 8 --batches 1,16 \
    --warmup 2 --frames 12 --output "$OUT/experts.json"
stage frame-step-compiled 110 python benchmarks/frame_step.py --config "$CONFIG" --device "$DEVICE" --layers 8 \
    --modes "$([ "$DEVICE" = cuda ] && echo eager,graph,compiled,compiled+graph || echo eager,compiled)" \
    --batches 1 --warmup 3 --frames 12 --ttfa-runs 1 --check-frames 8 --count-kernels --compile-layers 4,8 \
    --output "$OUT/frame-step-compiled.json"
echo "=== done ($(date -u +%H:%M:%S)); outputs in $OUT"
