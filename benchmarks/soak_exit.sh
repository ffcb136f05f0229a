#!/usr/bin/env bash
# Exit status of finished 2-rank runs under CPU load: a rank that finishes must exit 0
# (the race at exit that parallel.close_distributed() closes). Counts the runs that did not.
#
#   bash benchmarks/soak_exit.sh [WORKER_RUNS=60] [TRAIN_RUNS=20] [BURNERS=2] [OUT=output/soak_exit]
#
# WORKER_RUNS repeats of tests/dist_worker.py (3 GRPO steps on 2 gloo ranks, no server) and
# TRAIN_RUNS of a short `torchrun --nproc_per_node 2 train.py` (our vLLM CPU server, 3 steps,
# evaluation at the end), while BURNERS processes keep the cores busy. The log of every run
# that failed is kept under OUT; a line per kind gives the count.
set -uo pipefail
cd "$(dirname "$0")/.."
WORKER_RUNS=${1:-60}; TRAIN_RUNS=${2:-20}; BURNERS=${3:-2}; OUT=${4:-output/soak_exit}
PY=.venv/bin/python
mkdir -p "$OUT"
[ -d models/tiny ] || $PY scripts/make_tiny_model.py --out models/tiny > /dev/null
burners=()
for _ in $(seq 1 "$BURNERS"); do $PY -c "while True: pass" & burners+=($!); done
trap 'kill "${burners[@]}" 2>/dev/null' EXIT
export OMP_NUM_THREADS=1 PYTHONPATH=.

failed=0
for i in $(seq 1 "$WORKER_RUNS"); do
    $PY -m torch.distributed.run --nproc_per_node 2 --master_port $((29700 + i % 50)) tests/dist_worker.py train \
        models/tiny "$OUT/worker.pt" reshard_after_forward=false activation_checkpointing=true > "$OUT/worker_$i.log" 2>&1 \
        && rm "$OUT/worker_$i.log" || { failed=$((failed + 1)); echo "worker run $i failed: $OUT/worker_$i.log"; }
done
echo "2-rank worker: $((WORKER_RUNS - failed)) of $WORKER_RUNS exited 0 ($BURNERS CPU burners beside it)"

failed=0
for i in $(seq 1 "$TRAIN_RUNS"); do
    $PY -m torch.distributed.run --nproc_per_node 2 --master_port $((29750 + i % 50)) train.py \
        --model_name_or_path models/tiny --output_dir "$OUT/train" --num_training_steps 3 --eval_freq 3 \
        --vllm_port $((8300 + i % 50)) > "$OUT/train_$i.log" 2>&1 \
        && rm "$OUT/train_$i.log" || { failed=$((failed + 1)); echo "train.py run $i failed: $OUT/train_$i.log"; }
done
echo "2-rank train.py: $((TRAIN_RUNS - failed)) of $TRAIN_RUNS exited 0 ($BURNERS CPU burners beside it)"
