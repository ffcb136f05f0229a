#!/usr/bin/env bash
# One node with 8 GPUs: vLLM servers on some GPUs, the FSDP2 trainer on the rest.
#
#   bash scripts/launch_8gpu.sh                                   # Qwen2.5-0.5B, vLLM on GPUs 0-1, training on 2-7
#   MODEL=Qwen/Qwen2.5-1.5B VLLM_GPUS="0 1" TRAIN_GPUS=2,3,4,5,6,7 bash scripts/launch_8gpu.sh --learning_rate 1e-6
#   TRANSPORT=nccl VLLM_GPUS=0 TRAIN_GPUS=1,2,3,4,5,6,7 ... --num_unique_prompts_rollout 56   # NCCL weight sync
#   LORA_RANK=16 bash scripts/launch_8gpu.sh --learning_rate 1e-5  # LoRA adapters; the servers load each new one
#
# Arguments after the script's name go to train.py and win over the flags below.
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
LORA_RANK=${LORA_RANK:-0}                # > 0: train LoRA adapters of this rank (lora.py) and serve them
OUT=${OUT:-output/8gpu}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"

# The servers must start from an untied copy of the model: the trainer always pushes an
# untied lm_head, and a server started on a tied model would keep a stale LM head.
[ -f "$SERVING/config.json" ] || "$PYTHON" scripts/make_serving_copy.py --model "$MODEL" --out "$SERVING"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

urls=()
port=$PORT
for gpu in $VLLM_GPUS; do
    # The same server train.py launches for itself (vllm_server.launch_server), on one GPU:
    #   VLLM_SERVER_DEV_MODE=1         enables /collective_rpc (reload_weights), /reset_prefix_cache,
    #                                  /pause and /resume, the routes weight sync uses
    #   --dtype bfloat16               the trainer computes in bf16 on GPUs (MixedPrecisionPolicy);
    #                                  the per-step logprob check compares the two
    #   --max-model-len 2048           prompt + completion budget; at least max_prompt_length + response_length
    #   --seed 1                       reproducible sampling (each request also carries a seed)
    #   --logprobs-mode processed_logprobs   logprobs after temperature, as the trainer computes them
    #   --disable-log-stats            no periodic stats lines in the log
    #   --gpu-memory-utilization 0.9   memory fraction for weights and KV cache on this GPU
    #   --generation-config vllm       vLLM's neutral sampling defaults, not the model's generation_config.json
    #   --hf-overrides head_dtype      the LM head in float32, as the trainer computes its logprobs
    #   --weight-transfer-config       only for TRANSPORT=nccl: vLLM's native NCCL weight transfer
    #   --enable-lora, --max-lora-rank only for LORA_RANK > 0 (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
    #                                  the load and unload routes): each sync loads the new adapter by name
    #                                  (max-lora-rank: one of vLLM's values 8, 16, 32, 64, 128, 256, 320, 512)
    extra=()
    [ "$TRANSPORT" = nccl ] && extra=(--weight-transfer-config '{"backend": "nccl"}')
    if [ "$LORA_RANK" -gt 0 ]; then
        max_rank=8; while [ "$max_rank" -lt "$LORA_RANK" ]; do max_rank=$((max_rank * 2)); done
        extra+=(--enable-lora --max-lora-rank "$max_rank" --max-loras 1)
    fi
    CUDA_VISIBLE_DEVICES=$gpu VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "$PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$SERVING" --host 127.0.0.1 --port "$port" --dtype bfloat16 --max-model-len 2048 --seed 1 \
        --generation-config vllm --hf-overrides '{"head_dtype": "float32"}' \
        --logprobs-mode processed_logprobs --disable-log-stats --gpu-memory-utilization 0.9 "${extra[@]}" \
        >"$OUT/vllm_$port.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
    port=$((port + 1))
done
if [ "$TRANSPORT" = nccl ] && [ ${#urls[@]} -ne 1 ]; then
    echo "TRANSPORT=nccl supports one server; set VLLM_GPUS to one GPU" >&2; exit 2
fi

for url in "${urls[@]}"; do  # wait until every server answers /health
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
#   --weight_sync_transport          filesystem: rank 0 writes safetensors to /dev/shm on this node and
#                                    each server reloads them (the servers must share this node);
#                                    nccl: vLLM's weight-transfer API, rank 0 broadcasts to one server
#   --num_unique_prompts_rollout 48  48 prompts x 8 samples = 384 sequences: about 64 per rank on 6
#                                    ranks, spread by tokens
#   --max_tokens_per_micro_batch 16384  tokens packed into one forward/backward on one GPU
#   --response_length 1024           max new tokens per completion
#   --max_prompt_length 1024         longer prompts are skipped and counted
CUDA_VISIBLE_DEVICES=$TRAIN_GPUS "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$ntrain" \
    train.py --model_name_or_path "$MODEL" --output_dir "$OUT" \
    --vllm_server_urls "$(IFS=,; echo "${urls[*]}")" --weight_sync_transport "$TRANSPORT" \
    --num_unique_prompts_rollout 48 --num_samples_per_prompt_rollout 8 --max_tokens_per_micro_batch 16384 \
    --response_length 1024 --max_prompt_length 1024 --lora_rank "$LORA_RANK" "$@"
