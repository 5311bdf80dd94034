#!/usr/bin/env bash
# Builds the distribution wheel (zstd linked statically, no test-only runtime) and checks that its
# extension needs no libzstd shared library, so `pip install pyckpt-*.whl` works on a machine
# without zstd. Usage: scripts/check_wheel.sh [python] [outdir]   (default .venv/bin/python, dist)
# The build directory is kept (build/wheel-static): a rerun only recompiles what changed.
# pip builds in an isolated environment (scikit-build-core and pybind11 from the index), as
# scripts/setup.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
# Absolute: the interpreter's folder goes on PATH for the build, and CMake's nested configure
# steps (try_compile) run elsewhere, where a relative .venv/bin/ninja does not exist.
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
OUT=${2:-dist}
mkdir -p "$OUT"
rm -f "$OUT"/pyckpt-*.whl
# zstd is compiled into the extension from source: distributions' libzstd.a is often built
# without -fPIC (Debian's is) and cannot be linked into a shared extension. The sources are
# PYCKPT_ZSTD_SOURCE (a zstd release tree, or a directory with the single-file zstd.c), else the
# single-file zstd that python-zstandard's source distribution carries, fetched with pip.
SRC=${PYCKPT_ZSTD_SOURCE:-}
if [ -z "$SRC" ]; then
  SRC=build/zstd-source
  if [ ! -f "$SRC/zstd.c" ]; then
    rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
    "$PY" -m pip download -q --no-deps --no-binary :all: "zstandard==0.25.0" -d "$SRC.tmp"
    tar -xzf "$SRC.tmp"/zstandard-0.25.0.tar.gz -C "$SRC.tmp"
    rm -rf "$SRC" && mv "$SRC.tmp/zstandard-0.25.0/zstd" "$SRC" && rm -rf "$SRC.tmp"
  fi
fi
PATH="$(dirname "$PY"):$PATH" "$PY" -m pip wheel . --no-deps -q -w "$OUT" \
  -Cbuild-dir=build/wheel-static -Ccmake.define.PYCKPT_ZSTD_STATIC=ON \
  -Ccmake.define.PYCKPT_ZSTD_SOURCE="$(cd "$SRC" && pwd)"
WHEEL=$(ls "$OUT"/pyckpt-*.whl)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m zipfile -e "$WHEEL" "$TMP"
SO=$(ls "$TMP"/pyckpt/_C*.so)
NEEDED=$(readelf -d "$SO" | grep NEEDED || true)
echo "$WHEEL: $(basename "$SO") needs:"
echo "$NEEDED"
if echo "$NEEDED" | grep -q 'libzstd'; then
  echo "FAILED: the extension links libzstd dynamically; distribution wheels must carry it" >&2
  exit 1
fi
# Only the module init is exported (csrc/bindings/exports.map): a statically linked libstdc++ or
# zstd must not leak symbols that the loader could bind against another copy in the process.
EXPORTED=$(nm -D --defined-only "$SO" | awk '{print $NF}')
if [ "$EXPORTED" != "PyInit__C" ]; then
  echo "FAILED: the extension exports more than PyInit__C:" >&2
  echo "$EXPORTED" | head -20 >&2
  exit 1
fi
if ls "$TMP"/pyckpt/_testing/*.so >/dev/null 2>&1; then
  echo "FAILED: the test-only CUDA runtime double is in the distribution wheel" >&2
  exit 1
fi
# The statically linked zstd works: a compressed round trip through the wheel's extension.
# Run from inside the unpacked wheel: the checkout's own pyckpt/ must not shadow it.
(cd "$TMP" && PYTHONPATH="$TMP" "$PY" -c '
import sys, tempfile, torch, pyckpt
from pyckpt import _C
assert _C.__file__.startswith(sys.argv[1]), _C.__file__
sd = {"w": torch.randn(256, 256, dtype=torch.bfloat16)}
with tempfile.TemporaryDirectory() as d:
    pyckpt.save(sd, d, compression="zstd")
    back = {"w": torch.zeros_like(sd["w"])}
    pyckpt.load(back, d)
assert torch.equal(back["w"], sd["w"])
print("zstd", _C.zstd_version, "round trip through", _C.__file__)
' "$TMP")
echo "OK: no libzstd dependency; only PyInit__C exported"
