#!/usr/bin/env bash
# What only a GPU shows, in one run on a machine with torch and transformers (no vLLM, no model
# files: random weights of each shape). Each check's output goes to $OUT (default output/gpu_checks).
#
#   bash benchmarks/gpu_checks.sh            # about 8 minutes on one H100 or H200
#
# 1. Shared prompts, one flex_attention call per layer (attention.flex_row) against unshared rows:
#    time of the training phase and exactness, at SmolLM2-135M's and Qwen2.5-0.5B's shapes, on the
#    math and tools demos' batches and on 2,000-token prompts (benchmarks/bench_prefix.py).
# 2. The trainer's step at Qwen2.5-0.5B's and -1.5B's shapes in bf16 on one GPU: time, MFU, and
#    torch.cuda.max_memory_allocated beside the memory plan (benchmarks/bench_scaling.py).
# 3. Where pytest is installed: the one-call kernel's gradients against the unshared row's
#    (tests/test_packing.py -k on_a_gpu; it skips without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-output/gpu_checks}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
if $py -c "import pytest" 2>/dev/null; then
    $py -m pytest -q -p no:cacheprovider -o addopts="" tests/test_packing.py -k on_a_gpu 2>&1 | tail -15 | tee "$out/flex_gradients.txt"
fi
$py benchmarks/bench_prefix.py --random smollm2 --device cuda --repeats 5 --shapes math tools 4x8:2000:200 2>&1 \
    | tee "$out/prefix_smollm2.txt"
$py benchmarks/bench_prefix.py --random 0.5b --device cuda --repeats 3 --shapes math tools 4x8:2000:200 2>&1 \
    | tee "$out/prefix_0.5b.txt"
$py benchmarks/bench_scaling.py --models 0.5b,1.5b --worlds 1 --max_tokens 16384 --steps 3 2>&1 | tee "$out/scaling.txt"
