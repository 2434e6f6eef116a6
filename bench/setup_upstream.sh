#!/usr/bin/env bash
# Create bench/.venv-upstream: upstream onnxruntime-training 1.19.2 for the `upstream` system.
# Usage: bash bench/setup_upstream.sh   (from the repository root or anywhere)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-upstream}"
python="${PYTHON:-python}"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet onnxruntime-training==1.19.2 onnx==1.16.2 "numpy<2"
"$venv/bin/python" -c "import onnxruntime, onnx; from onnxruntime.training import artifacts, api; print('upstream venv ready:', onnxruntime.__version__, 'onnx', onnx.__version__)"
