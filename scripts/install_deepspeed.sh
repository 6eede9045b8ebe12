#!/usr/bin/env bash
# Install DeepSpeed CPU-only into the project venv, for `zenflow bench` comparisons only.
# DeepSpeed is an optional extra and never a runtime dependency of zenflow.
# DS_BUILD_OPS=0 skips compiling the C++/CUDA ops at install time; DeepSpeed JIT-builds its
# CPU Adam the first time it is used (about a minute), which needs ninja and a C++ compiler.
set -euo pipefail
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "no venv at $VENV: run 'make install' first (or set VENV=...)" >&2
    exit 1
fi
"$PY" -c "import torch" 2>/dev/null || { echo "torch is not installed in $VENV" >&2; exit 1; }
# Build-time and JIT-time needs that --no-build-isolation does not pull in by itself.
"$PY" -m pip install -q ninja packaging py-cpuinfo psutil hjson msgpack pydantic tqdm numpy einops
DS_BUILD_OPS=0 "$PY" -m pip install -q --no-build-isolation "deepspeed>=0.17,<0.20"
"$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__, 'installed')"
