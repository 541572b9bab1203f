#!/usr/bin/env bash
# Compiles and links the CUDA/NCCL variant of fastcomm (no GPU needed) and imports it once.
# Uses .venv-cuda (created if missing: the CUDA build of torch and nvidia-nccl-cu13, from the
# machine's local package index) and its own build dir, so the CPU build in .venv is untouched.
# Needs nvcc (CUDA_HOME, default /usr/local/cuda). Idempotent: a rerun only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
if [ ! -x .venv-cuda/bin/python ]; then
  python3 -m venv .venv-cuda
fi
# pip is a no-op when the pins are satisfied; the first run installs ~5.5 GB from local disk.
.venv-cuda/bin/python -m pip install -q --disable-pip-version-check \
  "torch==${FASTCOMM_CUDA_TORCH:-2.14.1}" nvidia-nccl-cu13 numpy pybind11 ninja "cmake>=3.18"
PY=.venv-cuda/bin/python
BUILD=build/cuda-check
TORCH_PREFIX=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
.venv-cuda/bin/cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFASTCOMM_NCCL=ON \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython_EXECUTABLE="$PWD/$PY" \
  -DCMAKE_MAKE_PROGRAM="$PWD/.venv-cuda/bin/ninja" -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" >/dev/null
.venv-cuda/bin/cmake --build "$BUILD" --parallel "$(nproc)"
# Import the package with this module (a copy, so the source tree keeps the CPU module).
PKG="$BUILD/pkg"
rm -rf "$PKG" && mkdir -p "$PKG/fastcomm"
cp fastcomm/*.py "$PKG/fastcomm/"
cp "$BUILD"/_C*.so "$PKG/fastcomm/"
(cd "$PKG" && "$OLDPWD/$PY" -c 'import fastcomm, torch; assert fastcomm.has_nccl(), "no NCCL path"; print("fastcomm CUDA build OK: torch", torch.__version__, "CUDA", torch.version.cuda, "cuda available:", torch.cuda.is_available())')
