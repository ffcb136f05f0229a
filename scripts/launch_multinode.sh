#!/usr/bin/env bash
# Several nodes: the FSDP2 trainer over every GPU of NNODES nodes with torchrun's c10d
# rendezvous, against vLLM servers you started already (scripts/launch_8gpu.sh shows the
# server command and its flags; scripts/serve.py starts one).
#
# Run the same command on every node (it becomes that node's torchrun agent: its pid is the agent's):
#   NNODES=2 MASTER=node0:29500 VLLM_URLS=http://node0:8000 bash scripts/launch_multinode.sh --weight_sync_dir /shared/fs/run1
#
# On one CPU machine as two nodes of one gloo rank each (tests/test_multinode.py runs this,
# against a server started by scripts/serve.py --serve on the same flags):
#   NNODES=2 GPUS_PER_NODE=1 NODE_ADDR=127.0.0.1 MASTER=127.0.0.1:29500 MODEL=models/tiny \
#     VLLM_URLS=http://127.0.0.1:8011 bash scripts/launch_multinode.sh --weight_sync_dir /tmp/sync ...   # twice
#
# Arguments after the script's name go to train.py and win over the flags below. Run here only
# on one CPU machine as two nodes; NCCL across nodes, InfiniBand and a shared filesystem have
# never been tried (docs/running.md, "Several nodes").
#
# Which node holds trainer rank 0 is not yours to choose: the c10d rendezvous gives ranks to
# the nodes in the order of their addresses (then their agents' pids), whatever order they
# join in (torch's dynamic_rendezvous), and torchrun ignores --node_rank with it.
#
# Weight sync across nodes: the filesystem transport writes where trainer rank 0 runs
# (/dev/shm unless --weight_sync_dir) and asks the servers to read that path, so the servers
# must see that directory: pass --weight_sync_dir on a filesystem every node and server
# shares. For servers elsewhere without one, TRANSPORT=nccl with one server started with
# --weight-transfer-config '{"backend": "nccl"}'; rank 0 then listens on WEIGHT_SYNC_ADDR:29555
# and the server joins it (rank 0 must then run on the node WEIGHT_SYNC_ADDR names).
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:?set NNODES, the number of nodes}
MASTER=${MASTER:?set MASTER=host:port, the rendezvous endpoint (any free port on one node)}
VLLM_URLS=${VLLM_URLS:?set VLLM_URLS, the servers comma separated}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}        # ranks on this node: one per GPU (on a CPU: gloo ranks)
NODE_ADDR=${NODE_ADDR:-}                 # this node's address as the others reach it; unset: its hostname
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}        # hub name or local directory of the policy to train
TRANSPORT=${TRANSPORT:-filesystem}
WEIGHT_SYNC_ADDR=${WEIGHT_SYNC_ADDR:-${MASTER%%:*}}  # nccl transport: trainer rank 0's address as the server sees it
OUT=${OUT:-output/multinode}
PYTHON=${PYTHON:-.venv/bin/python}       # the Python whose torch.distributed.run (torchrun) starts the ranks

# torchrun flags:
#   --nnodes NNODES               how many nodes join the job (fixed size: NNODES, or MIN:MAX for elastic)
#   --nproc_per_node              one trainer rank per GPU of this node
#   --rdzv_backend c10d           rendezvous through a TCP store hosted by the agent on MASTER's host
#   --rdzv_endpoint MASTER        host:port of that store; the same on every node
#   --rdzv_id                     names this job, so two jobs on one endpoint do not mix
#   --local_addr NODE_ADDR        (when set) the address the other nodes use for this one: rank 0's
#                                 node's becomes every rank's MASTER_ADDR. Unset, torchrun takes the
#                                 host's fully qualified name, which must resolve on every node
# train.py flags:
#   --vllm_server_urls            the servers; rank 0 alone talks to them and broadcasts the batch
#   --weight_sync_transport       see above
#   --weight_sync_master_address  nccl transport only: where the server finds trainer rank 0
#   --num_unique_prompts_rollout  prompts x samples, spread over NNODES x GPUS_PER_NODE ranks by tokens
#                                 (64 x 8 = 512 sequences: about 32 a rank on 16 GPUs)
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER" --rdzv_id "${RDZV_ID:-flatgrpo}" \
    ${NODE_ADDR:+--local_addr "$NODE_ADDR"} \
    train.py --model_name_or_path "$MODEL" --output_dir "$OUT" --vllm_server_urls "$VLLM_URLS" \
    --weight_sync_transport "$TRANSPORT" --weight_sync_master_address "$WEIGHT_SYNC_ADDR" \
    --num_unique_prompts_rollout 64 --num_samples_per_prompt_rollout 8 --max_tokens_per_micro_batch 16384 \
    --response_length 1024 --max_prompt_length 1024 "$@"
