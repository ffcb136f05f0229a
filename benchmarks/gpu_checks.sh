#!/usr/bin/env bash
# What only a GPU shows, in one run. Each check's output goes to $OUT (default output/gpu_checks),
# each stage's seconds and exit status to $OUT/stages.tsv.
# NEVER RUN WHOLE ON A GPU: the stages' limits are guesses; stages.tsv records what each took.
#
# Needs:
#   - one CUDA GPU (the colocated stage: NGPUS, default all) and `timeout` (coreutils)
#   - torch with CUDA and transformers (stages 1-3 load no vLLM and no model files: random weights of
#     each shape); pytest for stage 1 (skipped without it)
#   - for stage 4 only: the GPU build of vLLM 0.32 and MODEL_05B (MODEL_15B), local model directories
#     (benchmarks/gpu_colocated.sh, whose header says what it needs); skipped without MODEL_05B
#
#   bash benchmarks/gpu_checks.sh
#   MODEL_05B=/models/Qwen2.5-0.5B bash benchmarks/gpu_checks.sh      # with the colocated run
#
# 1. Where pytest is installed: the one-call kernel's gradients against the unshared row's
#    (tests/test_packing.py -k on_a_gpu; it skips without a GPU).
# 2. Shared prompts, one flex_attention call per layer (attention.flex_row) against unshared rows:
#    time of the training phase and exactness, at SmolLM2-135M's and Qwen2.5-0.5B's shapes, on the
#    math and tools demos' batches and on 2,000-token prompts (benchmarks/bench_prefix.py).
# 3. The trainer's step at Qwen2.5-0.5B's and -1.5B's shapes in bf16 on one GPU: time, MFU, and
#    torch.cuda.max_memory_allocated beside the memory plan (benchmarks/bench_scaling.py).
# 4. The colocated path: 2 steps of train.py with the server asleep on the training GPUs, the sync
#    check's gap in bf16, each phase's memory beside the plan, sleep, wake and sync times
#    (benchmarks/gpu_colocated.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
[ $# -eq 0 ] || { echo "error: benchmarks/gpu_checks.sh takes no arguments (settings are environment variables: --help)" >&2; exit 2; }
out=${OUT:-output/gpu_checks}
py=${PYTHON:-python3}
. benchmarks/gpu_common.sh

command -v timeout >/dev/null || fail "timeout (coreutils) not found: every stage runs under a time limit"
need_gpus 1 benchmarks/gpu_checks.sh
"$py" -c "import transformers" 2>/dev/null || fail "$py cannot import transformers; pip install -e . (or set PYTHON)"
mkdir -p "$out"
: >"$out/stages.tsv"

stage machine 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
    '"$py"' -c "import torch, transformers; print(torch.__version__, transformers.__version__)"'
if "$py" -c "import pytest" 2>/dev/null; then
    stage flex_gradients 900 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_packing.py -k on_a_gpu
fi
stage prefix_smollm2 900 "$py" benchmarks/bench_prefix.py --random smollm2 --device cuda --repeats 5 \
    --shapes math tools 4x8:2000:200
stage prefix_0.5b 900 "$py" benchmarks/bench_prefix.py --random 0.5b --device cuda --repeats 3 \
    --shapes math tools 4x8:2000:200
stage scaling 1200 "$py" benchmarks/bench_scaling.py --models 0.5b,1.5b --worlds 1 --max_tokens 16384 --steps 3
if [ -n "${MODEL_05B:-}" ]; then  # its own stages, preflight and summary, in $OUT/colocated
    stage colocated 3000 env OUT="$out/colocated" bash benchmarks/gpu_colocated.sh
else
    echo "== colocated: skipped (set MODEL_05B to a local Qwen2.5-0.5B directory; benchmarks/gpu_colocated.sh)"
fi
stages_summary
