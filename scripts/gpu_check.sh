#!/usr/bin/env bash
# The GPU check in one command (docs/gpu-check.md): every CUDA step of benchmarks/gpu/main.py, ~7 minutes on one
# H100, results in OUT_DIR (default benchmarks/gpu/results/<UTC time>); arguments after OUT_DIR go to main.py (e.g.
# --only cuda_tests,train_minilm). PYTHON: an interpreter whose torch is a CUDA build (default .venv's;
# scripts/setup.sh says how to install one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-benchmarks/gpu/results/$(date -u +%Y%m%d-%H%M)}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
'no CUDA device for this torch (' + torch.__version__ + '): see scripts/setup.sh, TORCH_INDEX')"
exec "$PYTHON" benchmarks/gpu/main.py "$OUT" "${@:2}"
