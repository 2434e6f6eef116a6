#!/usr/bin/env bash
# Create bench/.venv-upstream: upstream onnxruntime-training 1.19.2 for the bench's `upstream` system.
# Usage: bash bench/setup_upstream.sh [VENV_DIR]   (PYTHON=python3.11 to choose the interpreter)
# onnxruntime-training 1.19.2 has wheels for CPython 3.8-3.12. Its package __init__ imports torch
# (for ORTModule), which the on-device API does not need: bench/upstream_worker.py imports
# onnxruntime.training.artifacts/api without it, so torch is not installed here.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-upstream}"
python="${PYTHON:-python}"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet onnxruntime-training==1.19.2 onnx==1.16.2 "numpy<2"
"$venv/bin/python" "$here/upstream_worker.py" --check
