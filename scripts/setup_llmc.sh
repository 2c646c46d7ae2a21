#!/usr/bin/env bash
# The reference tool for scripts/bench_prune.py, in its own venv so its pins never touch ours.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMC_VENV:-.bench-venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q "llmcompressor==${LLMC_VERSION:-0.14.0.1}"
