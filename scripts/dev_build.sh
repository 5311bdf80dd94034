#!/usr/bin/env bash
# Incremental in-tree build for development: compiles pyckpt._C (and the CUDA runtime test double)
# into build/dev and copies them next to the sources, so `PYTHONPATH=. python -m pytest` works
# without reinstalling. Usage: scripts/dev_build.sh [python]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BUILD=build/dev
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPYCKPT_BUILD_PYTHON=ON \
    -DPYCKPT_BUILD_TESTING_RUNTIME=ON \
    -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
    -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" ${PYCKPT_CMAKE_ARGS:-} >/dev/null
elif ! grep -q '^PYCKPT_BUILD_TESTING_RUNTIME:BOOL=ON' "$BUILD/CMakeCache.txt"; then
  cmake "$BUILD" -DPYCKPT_BUILD_TESTING_RUNTIME=ON >/dev/null  # a build dir from before the option
fi
cmake --build "$BUILD" -j"$(nproc)"
cp "$BUILD"/_C*.so pyckpt/
if ls "$BUILD"/libpyckpt_fake_cudart.so >/dev/null 2>&1; then
  mkdir -p pyckpt/_testing && cp "$BUILD"/libpyckpt_fake_cudart.so pyckpt/_testing/
fi
