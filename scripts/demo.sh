#!/usr/bin/env bash
# Install (once), build the random tiny model (once), and run the embedded default on
# 2 CPU ranks: the built-in copy task, a vLLM CPU server started for you. Extra
# arguments go to train.py, e.g.  bash scripts/demo.sh --num_training_steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
[ -f models/tiny/config.json ] || .venv/bin/python scripts/make_tiny_model.py --out models/tiny
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/torchrun --nproc_per_node 2 train.py --model_name_or_path models/tiny --dataset copy \
    --output_dir output/demo "$@"
.venv/bin/python scripts/plot_metrics.py output/demo/metrics.jsonl
