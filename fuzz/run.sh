#!/usr/bin/env bash
# Runs every atheris (libFuzzer) harness in fuzz/ for a bounded time; exits non-zero on a finding.
#
# Usage: fuzz/run.sh [SECONDS_PER_HARNESS]        (default 60; PYTHON=... picks the interpreter)
#
# Each harness starts from its committed seed corpus (fuzz/corpus/<harness>/, read-only here) and
# writes new inputs to a scratch corpus; a crash, an uncaught untyped exception, a timeout of one
# input (10 s) or more than 4 GiB of memory is a finding: the input that caused it is kept under
# fuzz/findings/ (not committed) and the script fails. Reproduce with
#   python fuzz/<harness>.py fuzz/findings/<harness>/crash-<sha1>
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER=${1:-60}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
status=0
names=()
pids=()
scratch=$(mktemp -d)
# On any exit (an interrupted run included), no harness is left running behind.
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$scratch"' EXIT
# The harnesses run at the same time (each a single-threaded libFuzzer process), so the stage
# takes SECONDS_PER_HARNESS in all rather than once per harness; on 2 cores each harness then
# gets fewer executions in its time (CI stage: ~95 s -> ~35 s).
for harness in fuzz/fuzz_*.py; do
  name=$(basename "$harness" .py)
  mkdir -p "$scratch/$name" "fuzz/findings/$name"
  echo "[fuzz] $name for ${SECONDS_PER}s"
  "$PY" "$harness" "$scratch/$name" "fuzz/corpus/$name" \
    -max_total_time="$SECONDS_PER" -timeout=10 -rss_limit_mb=4096 -max_len=16384 \
    -artifact_prefix="fuzz/findings/$name/" -print_final_stats=1 \
    >"$scratch/$name.log" 2>&1 &
  names+=("$name")
  pids+=("$!")
done
for i in "${!names[@]}"; do
  name=${names[$i]}
  wait "${pids[$i]}"
  rc=$?
  grep -E "^(#[0-9]+ +DONE|Done [0-9]+ runs|stat::number_of_executed_units)" "$scratch/$name.log" \
    | sed "s/^/[fuzz] $name: /"
  if [ "$rc" -ne 0 ]; then
    echo "[fuzz] $name FAILED (exit $rc); the last lines of its log:"
    grep -v "^INFO: Instrumenting" "$scratch/$name.log" | tail -40
    ls -l "fuzz/findings/$name" 2>/dev/null
    status=1
  else
    rmdir "fuzz/findings/$name" 2>/dev/null
  fi
done
rmdir fuzz/findings 2>/dev/null
exit $status
