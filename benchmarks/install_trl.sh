#!/usr/bin/env bash
# A separate virtual environment for TRL (.venv-trl, git-ignored), used only by
# benchmarks/bench_trl.py to compare against TRL's GRPOTrainer. It is never a dependency of
# the trainer. No vLLM in it: on a CPU, TRL generates with transformers. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TRL_VENV:-.venv-trl}
TRL_VERSION=${TRL_VERSION:-1.16.0}  # the version the figures in BENCHMARKS.md were measured with
[ -f "$VENV/.installed-trl-$TRL_VERSION" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# torch first, the same CPU build as the trainer's (see README, "Installing elsewhere").
"$VENV/bin/python" -m pip install -q ${PIP_EXTRA_INDEX:+--extra-index-url "$PIP_EXTRA_INDEX"} "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "trl==$TRL_VERSION"
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed-trl-$TRL_VERSION"
