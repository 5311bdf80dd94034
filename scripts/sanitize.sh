#!/usr/bin/env bash
# Builds pyckpt._C with AddressSanitizer + UndefinedBehaviorSanitizer into build/asan (the normal
# build and the in-tree pyckpt/_C*.so are never touched), stages an importable copy of the package
# in build/asan/pkg, and runs pytest on it under the sanitizers. Exits non-zero when the tests fail
# or when any sanitizer report was written, including from subprocesses the tests start.
#
# Usage: scripts/sanitize.sh [pytest args...]
#   default args: tests/test_file_io.py tests/test_codec.py tests/test_safetensors_header.py
#        scripts/sanitize.sh --ctest
#   runs the C++ unit tests (tests/cpp, built into the same directory with warnings as errors)
#   under ctest instead: one sanitized build serves both, so CI compiles the core once for them.
#   PYTHON=/path/to/python (default .venv/bin/python); PYCKPT_SANITIZE (default address;undefined)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-.venv/bin/python}
SAN=${PYCKPT_SANITIZE:-address;undefined}
BUILD=build/asan
PKG=$BUILD/pkg
REPORTS=$BUILD/reports

# -O1, as the sanitizers' documentation suggests: on the 2-core VM the ASan+UBSan build took
# 228 s instead of 328 s at RelWithDebInfo's -O2, and the sanitize test run was no slower
# (142 s against 217 s, one run each). -g1 (line tables: reports still name file and line) and
# a unity build (each target's sources compiled as a few combined units, so pybind11's and the
# core's headers are parsed a few times instead of once per file) brought it from 303 s to 106 s
# (2026-11-29, one build each).
OPT="-O1 -g1 -DNDEBUG"
if [ -f "$BUILD/build.ninja" ] && ! { grep -q "^CMAKE_CXX_FLAGS_RELWITHDEBINFO:STRING=$OPT\$" \
    "$BUILD/CMakeCache.txt" && grep -q "^CMAKE_UNITY_BUILD:[A-Z]*=ON\$" "$BUILD/CMakeCache.txt"; }; then
  cmake "$BUILD" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$OPT" -DCMAKE_UNITY_BUILD=ON >/dev/null  # an older build dir
fi
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$OPT" -DCMAKE_UNITY_BUILD=ON -DPYCKPT_BUILD_PYTHON=ON \
    -DPYCKPT_BUILD_TESTING_RUNTIME=ON -DPYCKPT_BUILD_TESTS=ON -DPYCKPT_WERROR=ON \
    -DPYCKPT_SANITIZE="$SAN" \
    -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
    -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >/dev/null
fi
cmake --build "$BUILD" -j"$(nproc)"

if [ "${1:-}" = "--ctest" ]; then
  # The test executables link the sanitizer runtimes themselves: no preload needed.
  export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  exec ctest --test-dir "$BUILD" --output-on-failure
fi

# A copy of the Python sources with the sanitized extension (never the in-tree one).
rm -rf "$PKG"
mkdir -p "$PKG/pyckpt/_testing"
(cd pyckpt && find . -name '*.py' -o -name '*.pyi' -o -name 'py.typed') | while read -r f; do
  mkdir -p "$PKG/pyckpt/$(dirname "$f")"
  cp "pyckpt/$f" "$PKG/pyckpt/$f"
done
cp "$BUILD"/_C*.so "$PKG/pyckpt/"
cp "$BUILD"/libpyckpt_fake_cudart.so "$PKG/pyckpt/_testing/"

rm -rf "$REPORTS"
mkdir -p "$REPORTS"
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBUBSAN=$(gcc -print-file-name=libubsan.so)
PRELOAD=""
case "$SAN" in *address*) PRELOAD="$LIBASAN" ;; esac
case "$SAN" in *undefined*) PRELOAD="${PRELOAD:+$PRELOAD:}$LIBUBSAN" ;; esac
export LD_PRELOAD="$PRELOAD"
# Python itself is not instrumented and keeps objects alive at exit: leak checking is off.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$ROOT/$REPORTS/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$ROOT/$REPORTS/ubsan"
export PYTHONPATH="$ROOT/$PKG"
export PYTHONSAFEPATH=1  # do not put the checkout (with its own pyckpt/) first on sys.path
export PYTHONDEVMODE=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}

# Refuse to run if the sanitized copy is not the one imported.
"$PY" -c "import pyckpt._C as c, sys; sys.exit(0 if c.__file__.startswith('$ROOT/$PKG/') else \
'pyckpt._C imported from ' + c.__file__ + ', not the sanitized build')"

if [ "$#" -eq 0 ]; then
  set -- tests/test_file_io.py tests/test_codec.py tests/test_safetensors_header.py
fi
status=0
"$PY" -m pytest -p no:cacheprovider --rootdir=. -c pyproject.toml "$@" || status=$?
if compgen -G "$REPORTS/*" >/dev/null; then
  echo "[sanitize] sanitizer reports:" >&2
  for f in "$REPORTS"/*; do echo "== $f" >&2; cat "$f" >&2; done
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
