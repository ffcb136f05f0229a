#!/usr/bin/env bash
# One node with 8 GPUs: vLLM servers on some GPUs, the FSDP2 trainer on the rest.
#
#   bash scripts/launch_8gpu.sh                                   # Qwen2.5-0.5B, vLLM on GPUs 0-1, training on 2-7
#   MODEL=Qwen/Qwen2.5-1.5B VLLM_GPUS="0 1" TRAIN_GPUS=2,3,4,5,6,7 bash scripts/launch_8gpu.sh --learning_rate 1e-6
#   TRANSPORT=nccl VLLM_GPUS=0 TRAIN_GPUS=1,2,3,4,5,6,7 ... --num_unique_prompts_rollout 56   # NCCL weight sync
#   LORA_RANK=16 bash scripts/launch_8gpu.sh --learning_rate 1e-5  # LoRA adapters; the servers load each new one
#   DRY_RUN=1 bash scripts/launch_8gpu.sh                         # print the commands below, start nothing
#
# Arguments after the script's name go to train.py and to the servers, and win over the flags
# below. Each server is `scripts/serve.py --serve`: the very server train.py would launch for the
# same flags (vllm_server.server_command, and lora/sync.py server_flags: context length, seed, dtype,
# LoRA ranks, weight transfer, the routes weight sync uses), so the two never disagree.
# Needs the official GPU build of vLLM: pip install -e ".[gpu,dev,plot]".
# Not run on the machines this project is developed on (no GPU): check the log of
# each server (OUT/vllm_*.log) and the first steps' vllm_logp_diff_mean before a long run.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}        # hub name or local directory of the policy to train
SERVING=${SERVING:-serving/$(basename "$MODEL")}  # the untied copy the servers start from
VLLM_GPUS=${VLLM_GPUS:-"0 1"}            # one vLLM server per GPU listed (space separated)
TRAIN_GPUS=${TRAIN_GPUS:-2,3,4,5,6,7}    # the trainer's GPUs, one rank each (comma separated)
PORT=${PORT:-8000}                       # first server's port; the next server takes PORT + 1, ...
TRANSPORT=${TRANSPORT:-filesystem}       # weight sync: filesystem (any number of servers) or nccl (one server)
LORA_RANK=${LORA_RANK:-0}                # > 0: train LoRA adapters of this rank (lora/) and serve them
OUT=${OUT:-output/8gpu}
PYTHON=${PYTHON:-.venv/bin/python}

# The run's flags, the trainer's and the servers' alike:
#   --num_unique_prompts_rollout 48  48 prompts x 8 samples = 384 sequences: about 64 per rank on 6
#                                    ranks, spread by tokens
#   --max_tokens_per_micro_batch 16384  tokens packed into one forward/backward on one GPU
#   --response_length 1024           max new tokens per completion
#   --max_prompt_length 1024         longer prompts are skipped and counted (servers: a 2048-token context)
#   --weight_sync_transport          filesystem: rank 0 writes safetensors to /dev/shm on this node and
#                                    each server reloads them (the servers must share this node);
#                                    nccl: vLLM's weight-transfer API, rank 0 broadcasts to one server
flags=(--num_unique_prompts_rollout 48 --num_samples_per_prompt_rollout 8 --max_tokens_per_micro_batch 16384
       --response_length 1024 --max_prompt_length 1024 --weight_sync_transport "$TRANSPORT" --lora_rank "$LORA_RANK"
       "$@")
show() { printf '%q ' "$@"; echo; }

read -r -a gpus <<<"$VLLM_GPUS"
if [ "$TRANSPORT" = nccl ] && [ ${#gpus[@]} -ne 1 ]; then
    echo "TRANSPORT=nccl supports one server; set VLLM_GPUS to one GPU" >&2; exit 2
fi
[ -n "${DRY_RUN:-}" ] || mkdir -p "$OUT"

# The servers must start from an untied copy of the model: the trainer always pushes an
# untied lm_head, and a server started on a tied model would keep a stale LM head.
copy=("$PYTHON" scripts/make_serving_copy.py --model "$MODEL" --out "$SERVING")
if [ -n "${DRY_RUN:-}" ]; then show "${copy[@]}"; elif [ ! -f "$SERVING/config.json" ]; then "${copy[@]}"; fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

urls=()
port=$PORT
for gpu in "${gpus[@]}"; do
    server=("$PYTHON" scripts/serve.py --serve "$SERVING" "${flags[@]}" --vllm_port "$port")
    if [ -n "${DRY_RUN:-}" ]; then
        echo "CUDA_VISIBLE_DEVICES=$gpu $(CUDA_VISIBLE_DEVICES=$gpu "${server[@]}" --print)"
    else  # scripts/serve.py becomes the server: $! is the server's pid
        CUDA_VISIBLE_DEVICES=$gpu "${server[@]}" >"$OUT/vllm_$port.log" 2>&1 &
        pids+=($!)
    fi
    urls+=("http://127.0.0.1:$port")
    port=$((port + 1))
done

for url in "${urls[@]}"; do  # wait until every server answers /health
    [ -n "${DRY_RUN:-}" ] && break
    until curl -sf "$url/health" >/dev/null; do
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || { echo "a vLLM server exited; see $OUT/vllm_*.log" >&2; exit 1; }; done
        sleep 5
    done
done

ntrain=$(($(tr -cd , <<<"$TRAIN_GPUS" | wc -c) + 1))
# The trainer: one rank per training GPU, nccl, FSDP2 with bf16 compute and fp32 master weights.
#   --standalone                     a single-node rendezvous on a free port
#   --nproc_per_node                 one rank per GPU in TRAIN_GPUS
#   --vllm_server_urls               the servers above; rank 0 spreads requests over them
trainer=(env "CUDA_VISIBLE_DEVICES=$TRAIN_GPUS" "$PYTHON" -m torch.distributed.run --standalone
         --nproc_per_node "$ntrain" train.py --model_name_or_path "$MODEL" --output_dir "$OUT"
         --vllm_server_urls "$(IFS=,; echo "${urls[*]}")" "${flags[@]}")
if [ -n "${DRY_RUN:-}" ]; then show "${trainer[@]}"; else "${trainer[@]}"; fi
