#!/usr/bin/env bash
# Install (once) and run the whole test suite, the slow tests that start a vLLM CPU
# server and train on 2 gloo ranks included. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
