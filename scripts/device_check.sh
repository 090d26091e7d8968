#!/usr/bin/env bash
# The CUDA path checked on a GPU host in one command (scripts/device_check.py says what it runs and writes).
#   bash scripts/device_check.sh --prepare   # here, with PyPI: the wheels the GPU host lacks into .device-wheels/
#   bash scripts/device_check.sh --dry-run   # what would be carried and run (exit 0)
#   bash scripts/device_check.sh             # on the GPU host: install, cuda tests, smoke main job and benchmark;
#                                            # summary in ${OUT:-outputs/device-check}; no GPU: one line, exit 2
# PYTHON picks the interpreter (default: .venv/bin/python for --prepare, whose versions are pinned; else python3).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ "${1:-}" = "--prepare" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/device_check.py "$@"
