#!/usr/bin/env bash
# Sets up (idempotently, see scripts/setup.sh) and runs every check CI runs, in stages:
#   1. tests       the whole test suite (includes the attack corpus, tests/test_attacks.py, and
#                  the structure-aware metadata fuzz, tests/test_fuzz_metadata.py), on
#                  PYCKPT_TEST_WORKERS pytest-xdist workers (default 2), then the few tests that
#                  time CPU scheduling, alone (tests-serial)
#   2. benchmarks  a smoke run of the benchmarks (timings disabled)
#   3. fuzz        every atheris harness in fuzz/ for PYCKPT_FUZZ_SECONDS_PER_HARNESS (default 30)
#   4. sanitize    scripts/sanitize.sh: the C++-heavy tests, the attack corpus, the native
#                  metadata reader's differential tests and the export's stitcher tests
#                  against an ASan+UBSan build of the extension
#   5. cpp         the C++ unit tests (tests/cpp) under ctest, warnings as errors, in the
#                  sanitizer build (ASan+UBSan)
#   6. lint        ruff, mypy on pyckpt/, clang-format on csrc/ and tests/cpp/
#   7. wheel       scripts/check_wheel.sh: builds the distribution wheel (zstd linked statically)
#                  and checks with readelf that its extension has no libzstd.so dependency
# --quick (first argument): the fast lane, under 3 minutes on 2 cores (148-169 s measured with the
# machine shared): the tests stage only, without the slow lane (tests marked `slow` next to them:
# multi-process fault, crash, kill and timeout tests, fuzzing, the demo, the largest multi-rank
# cases; tests/test_lanes.py checks that every module keeps a fast test), and no tests-serial.
# CI runs everything.
# Extra arguments go to the stage-1 pytest run. PYCKPT_TEST_STAGES (default
# "lint wheel tests benchmarks fuzz sanitize cpp") selects stages, e.g. PYCKPT_TEST_STAGES=tests.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
  set -- -m "not slow" "$@"
fi
# stage_done NAME: how long the stage took and the run so far (a CI run should stay under ~25 min).
stage_start=$SECONDS
stage_done() {
  echo "=== [$1] $((SECONDS - stage_start)) s (run so far: $((SECONDS / 60)) min $((SECONDS % 60)) s)"
  stage_start=$SECONDS
}
scripts/setup.sh
stage_done setup
# .venv/bin/pytest (not "python -m pytest", which puts the checkout on sys.path) imports the
# installed package, never the source tree.
export PYTHONDEVMODE=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
STAGES=${PYCKPT_TEST_STAGES:-lint wheel tests benchmarks fuzz sanitize cpp}
[ "$quick" = 1 ] && STAGES=tests
status=0

# run_stage_pytest NAME MAY_BE_EMPTY CMD...: a run that collected nothing (pytest exit 5) fails unless
# MAY_BE_EMPTY is 1 (a selection that legitimately holds no test on this machine).
run_stage_pytest() {
  local name=$1 may_be_empty=$2 rc=0
  shift 2
  echo "=== [$name] $*"
  "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    if [ "$may_be_empty" = 1 ]; then
      echo "=== [$name] no tests selected (allowed for this stage)"
      rc=0
    else
      echo "=== [$name] FAILED: ran no tests"
    fi
  fi
  [ "$rc" -eq 0 ] || { echo "=== [$name] FAILED (exit $rc)"; status=1; }
  stage_done "$name"
}

has_stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# run_stage NAME CMD...: runs a non-pytest stage; a failure marks the run failed and goes on.
run_stage() {
  local name=$1
  shift
  echo "=== [$name] $*"
  "$@" || { echo "=== [$name] FAILED"; status=1; }
  stage_done "$name"
}

if has_stage lint; then
  run_stage lint .venv/bin/ruff check pyckpt tests benchmarks examples fuzz
  run_stage lint .venv/bin/mypy pyckpt
  # shellcheck disable=SC2046
  run_stage lint .venv/bin/clang-format --dry-run --Werror \
    $(git ls-files 'csrc/*.[ch]pp' 'tests/cpp/*.[ch]pp')
fi
if has_stage wheel; then
  # A few minutes on 2 cores the first time; build/wheel-static is kept, so later runs are
  # incremental. cmake, ninja and scikit-build-core come from the venv.
  PATH="$PWD/.venv/bin:$PATH" run_stage wheel scripts/check_wheel.sh .venv/bin/python dist
fi
if has_stage tests; then
  # Two workers (PYCKPT_TEST_WORKERS; 0 runs in this process), a whole module per worker so
  # module fixtures (a saved checkpoint, an S3 server) are made once: most of the suite waits on
  # child processes, timeouts and servers rather than computing, so two modules at a time on
  # 2 cores halve its wall time (944 -> 570 s measured on the 2-core VM). Modules go out in
  # collection order, longest first (tests/conftest.py, _LONGEST_FIRST), not xdist's default
  # order by test count, which left a long module of few tests for the end. The few tests that
  # measure CPU scheduling itself (the GIL release checks, SIGINT latency) run after, alone.
  SERIAL="tests/test_gil.py tests/test_interrupt.py"
  ignore=()
  for f in $SERIAL; do ignore+=(--ignore="$f"); done
  run_stage_pytest tests 0 .venv/bin/pytest -p no:cacheprovider --rootdir=. -c pyproject.toml \
    -n "${PYCKPT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 tests \
    "${ignore[@]}" "$@"
  # With a selection in "$@" (-k ...), these may hold none of it; the quick lane skips them.
  [ "$quick" = 1 ] && exit $status
  # shellcheck disable=SC2086
  run_stage_pytest tests-serial "$([ $# -gt 0 ] && echo 1 || echo 0)" .venv/bin/pytest \
    -p no:cacheprovider --rootdir=. -c pyproject.toml $SERIAL "$@"
fi
if has_stage benchmarks; then
  run_stage_pytest benchmarks 0 .venv/bin/pytest -p no:cacheprovider --rootdir=. \
    -c pyproject.toml benchmarks --benchmark-disable -q -o testpaths=benchmarks
fi
if has_stage fuzz; then
  echo "=== [fuzz] fuzz/run.sh ${PYCKPT_FUZZ_SECONDS_PER_HARNESS:-30}"
  PYTHON=.venv/bin/python fuzz/run.sh "${PYCKPT_FUZZ_SECONDS_PER_HARNESS:-30}" \
    || { echo "=== [fuzz] FAILED"; status=1; }
  stage_done fuzz
fi
if has_stage sanitize; then
  if [ ! -x scripts/sanitize.sh ] && [ ! -f scripts/sanitize.sh ]; then
    echo "=== [sanitize] FAILED: scripts/sanitize.sh is missing"
    status=1
  else
    # Slower under ASan: a longer per-task deadline for the attack workers; no RLIMIT_AS (ASan
    # reserves terabytes of shadow address space; harness.py drops the limit by itself too).
    # cmake, ninja and pybind11 come from the venv (the 'sanitize' extra).
    PATH="$PWD/.venv/bin:$PATH" PYTHON=.venv/bin/python \
    PYCKPT_ATTACK_TIMEOUT=${PYCKPT_ATTACK_TIMEOUT:-40} PYCKPT_FUZZ_SECONDS=20 \
      run_stage_pytest sanitize 0 bash scripts/sanitize.sh -q \
      tests/test_file_io.py tests/test_codec.py tests/test_safetensors_header.py \
      tests/test_attacks.py tests/test_fuzz_metadata.py tests/test_native_index.py \
      tests/test_consolidate_small.py tests/test_consolidate_pyckpt.py
  fi
fi
if has_stage cpp; then
  # In the sanitizer build directory (built by the sanitize stage, or here when that stage did
  # not run): the C++ unit tests run under ASan+UBSan, and the core is compiled once for both.
  PATH="$PWD/.venv/bin:$PATH" PYTHON=.venv/bin/python run_stage cpp bash scripts/sanitize.sh --ctest
fi
exit $status
