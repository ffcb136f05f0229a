#!/usr/bin/env bash
# Several nodes: the FSDP2 trainer over every GPU of NNODES nodes with torchrun's c10d
# rendezvous, against vLLM servers you started already (scripts/launch_8gpu.sh shows the
# server command and its flags).
#
# Run the same command on every node, with its own NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER=node0:29500 VLLM_URLS=http://node0:8000 bash scripts/launch_multinode.sh
#   NNODES=2 NODE_RANK=1 MASTER=node0:29500 VLLM_URLS=http://node0:8000 bash scripts/launch_multinode.sh
#
# Arguments after the script's name go to train.py. Not run on the machines this project
# is developed on (no GPU, one node).
#
# Weight sync across nodes: the filesystem transport writes on the node of trainer rank 0
# (/dev/shm) and asks the servers to read that path, so the servers must run on that node
# (or the path must be on a filesystem they share). For servers elsewhere use
# TRANSPORT=nccl with one server started with --weight-transfer-config '{"backend": "nccl"}';
# rank 0 then listens on WEIGHT_SYNC_ADDR:29555 and the server joins it.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:?set NNODES, the number of nodes}
NODE_RANK=${NODE_RANK:?set NODE_RANK, the index of this node, 0..NNODES-1}
MASTER=${MASTER:?set MASTER=host:port, the rendezvous endpoint (any free port on one node)}
VLLM_URLS=${VLLM_URLS:?set VLLM_URLS, the servers comma separated}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}
TRANSPORT=${TRANSPORT:-filesystem}
WEIGHT_SYNC_ADDR=${WEIGHT_SYNC_ADDR:-${MASTER%%:*}}  # nccl transport: trainer rank 0's address as the server sees it
OUT=${OUT:-output/multinode}
PYTHON=${PYTHON:-.venv/bin/python}

# torchrun flags:
#   --nnodes NNODES               how many nodes join the job (fixed size: NNODES, or MIN:MAX for elastic)
#   --node_rank NODE_RANK         this node's index; global ranks are node_rank * nproc_per_node + local rank
#   --nproc_per_node              one trainer rank per GPU of this node
#   --rdzv_backend c10d           rendezvous through a TCP store hosted by the first node to arrive
#   --rdzv_endpoint MASTER        host:port of that store; the same on every node
#   --rdzv_id                     names this job, so two jobs on one endpoint do not mix
# train.py flags:
#   --vllm_server_urls            the servers; rank 0 alone talks to them and broadcasts the batch
#   --weight_sync_transport       see above
#   --weight_sync_master_address  nccl transport only: where the server finds trainer rank 0
#   --num_unique_prompts_rollout  prompts x samples, spread over NNODES x GPUS_PER_NODE ranks by tokens
#                                 (64 x 8 = 512 sequences: about 32 a rank on 16 GPUs)
"$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER" --rdzv_id "${RDZV_ID:-flatgrpo}" \
    train.py --model_name_or_path "$MODEL" --output_dir "$OUT" --vllm_server_urls "$VLLM_URLS" \
    --weight_sync_transport "$TRANSPORT" --weight_sync_master_address "$WEIGHT_SYNC_ADDR" \
    --num_unique_prompts_rollout 64 --num_samples_per_prompt_rollout 8 --max_tokens_per_micro_batch 16384 \
    --response_length 1024 --max_prompt_length 1024 "$@"
