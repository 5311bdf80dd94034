#!/usr/bin/env bash
# Sets up everything pyckpt needs on a Debian/Ubuntu machine with Python >= 3.10, idempotently:
#   - system packages: libzstd-dev, pkg-config, a C++ compiler, python3-venv, openssl (apt, only
#     if missing)
#   - a virtual environment in .venv with torch==2.13.0 (CPU) and pyckpt built from this checkout
#     (non-editable, with the test/bench/model/demo/fuzz/sanitize/lint/s3/s3-test/s3-bench extras
#     and the trainers' extras: accelerate, lightning; torchtitan with its checkpointing needs)
# Usage: scripts/setup.sh            (PYTHON=python3.11 scripts/setup.sh to pick an interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# say MESSAGE: a progress line with the seconds since the start (CI logs show where time goes).
say() { echo "[pyckpt setup] $* (at ${SECONDS} s)"; }
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

missing=()
if ! { [ -f /usr/include/zstd.h ] || pkg-config --exists libzstd 2>/dev/null; }; then
  missing+=(libzstd-dev)
fi
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)  # the S3 tests' TLS certificate
if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing+=("python3-venv")
fi
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv
fi
PY="$PWD/.venv/bin/python"
QUIET_PIP='is ignored: it is neither a file nor a directory'  # noise from this machine's pip config

# torch first, pinned: a bare 'torch' requirement could pull a multi-GB CUDA build.
if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  say "installing torch==2.13.0"
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | { grep -v "$QUIET_PIP" || true; }
fi

say "building and installing pyckpt"
# The build requirements live in the venv and the build runs without pip's isolated build
# environment: an isolated one has a new temporary path on every run, its pybind11 include
# directory changes every compile command, and ninja then rebuilds every object. Here the
# build directory (build/<wheel tag>, pyproject.toml) is reused: a run with nothing changed
# compiles nothing, a one-file change recompiles that file.
"$PY" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.11" "pybind11>=3" \
  "cmake>=3.26" ninja 2>&1 | { grep -v "$QUIET_PIP" || true; }
# The trainers' extras are tested against the real packages; the constraint keeps any of their
# requirements from replacing torch 2.13.0 (a bare 'torch' would pull a multi-GB CUDA build).
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==2.13.0" >"$constraint"
# The CUDA runtime test double (pyckpt/_testing) is built only on request: the tests need it.
PATH="$(dirname "$PY"):$PATH" "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation \
  -c "$constraint" -Ccmake.define.PYCKPT_BUILD_TESTING_RUNTIME=ON \
  ".[test,bench,model,demo,fuzz,sanitize,lint,s3,s3-test,s3-bench,accelerate,lightning]" 2>&1 \
  | { grep -v "$QUIET_PIP" || true; }
say "installing torchtitan"
# torchtitan (the `torchtitan` extra) with what its checkpoint, optimizer and state-dict-adapter
# modules import: its training-data and logging requirements (datasets with pyarrow and pandas,
# wandb, tensorboard) are not used by checkpointing and would double the setup time.
"$PY" -m pip install -q --disable-pip-version-check -c "$constraint" --no-deps \
  "torchtitan>=0.3.0,<0.4" 2>&1 | { grep -v "$QUIET_PIP" || true; }
# pip reports the requirements left out (datasets, tensorboard, torchdata, wandb) as missing.
"$PY" -m pip install -q --disable-pip-version-check -c "$constraint" \
  tyro "spmd_types==0.2.3" torch_checkpointing einops 2>&1 | { grep -v "$QUIET_PIP" || true; }
# Checked from outside the checkout, whose pyckpt/ (without the built _C) would shadow the install.
(cd / && "$PY" -c 'import pyckpt, pyckpt._C; print("[pyckpt setup] pyckpt", pyckpt.__version__, "with zstd", pyckpt._C.zstd_version)')
say "done"
