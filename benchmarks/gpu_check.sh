#!/usr/bin/env bash
# The one-shot GPU check, for a lent GPU machine with PyTorch, Triton and transformers preinstalled and no network:
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh          # from the repository root; src/ goes on PYTHONPATH
#
# Stages, most important first, each bounded in time (a stage that fails or runs out of time does not stop the
# next); every stage writes its raw output under $OUT:
#   1. machine facts;
#   2. the CUDA tests (CUDA graph replay == eager frames, the codec on its own stream);
#   3. the frame step at real size, full depth: eager and CUDA-graph steps at batch 1 and 16, time to first audio,
#      codec share, memory, same-frames check (benchmarks/frame_step.py --config real);
#   4. the compiled step at real width and 8 layers: eager, graph, compiled, compiled+graph side by side, and the
#      kernels per frame of the eager and the compiled step (compiling all 40 layers would take longer than a
#      session's GPU time; the step's cost is about linear in the depth, see docs/performance.md);
#   5. the routed experts kept in FP8 (needs transformers' FP8 kernels: reports what is missing if they are not there);
#   6. the routed experts in each format at real width and 8 layers, side by side: dequantised, FP8 kept on the
#      selected-experts path, bitsandbytes 4-bit (benchmarks/expert_formats.py).
# DEVICE=cpu CONFIG=tiny runs the same stages on a CPU with the tiny geometry (a dry run of this script).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-gpu-check}
DEVICE=${DEVICE:-cuda}
CONFIG=${CONFIG:-real}
mkdir -p "$OUT"

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in $OUT/NAME.txt
    local name=$1 seconds=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${seconds}s): $*"
    timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
    echo "=== $name exit $? ($(date -u +%H:%M:%S))"
    tail -n 40 "$OUT/$name.txt"
}

stage machine 60 bash -c 'date -u; nvidia-smi || true; python -c "import torch, transformers, platform;
print(platform.platform(), \"python\", platform.python_version());
print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"cuda\", torch.cuda.is_available())"'
if [ "$DEVICE" = cuda ]; then
    stage cuda-tests 240 python -m pytest -q -p no:cacheprovider tests/test_frame_step.py -k cuda -rs
fi
stage frame-step 300 python benchmarks/frame_step.py --config "$CONFIG" --device "$DEVICE" \
    --modes "$([ "$DEVICE" = cuda ] && echo eager,graph || echo eager)" --batches 1,16 --warmup 4 --frames 24 \
    --output "$OUT/frame-step.json"
stage frame-step-compiled 420 python benchmarks/frame_step.py --config "$CONFIG" --device "$DEVICE" --layers 8 \
    --modes "$([ "$DEVICE" = cuda ] && echo eager,graph,compiled,compiled+graph || echo eager,compiled)" \
    --batches 1 --warmup 3 --frames 16 --ttfa-runs 1 --check-frames 8 --count-kernels --compile-layers 4,8 \
    --output "$OUT/frame-step-compiled.json"
stage fp8-experts 90 python benchmarks/fp8_experts.py --config "$CONFIG" --device "$DEVICE" --output "$OUT/fp8-experts.json"
stage expert-formats 90 python benchmarks/expert_formats.py --config "$CONFIG" --device "$DEVICE" --layers 8 \
    --batches 1,16 --warmup 2 --frames 12 --output "$OUT/expert-formats.json"
echo "=== done ($(date -u +%H:%M:%S)); outputs in $OUT"
